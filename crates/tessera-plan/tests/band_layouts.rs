//! `band` plans over the features layout masks use (NATTEN's clamped window starts on a canvas
//! flattened row-major or tile by tile, dilation groups, positions inside repeating frames,
//! 0/1 flags), checked pair by pair and tile by tile against the band's definition. These
//! features exercise every stage-2 path of the band leaf: sorted key tiles, tiles of a few sorted
//! runs (frame and canvas-row boundaries) and of many (tile orders, residues, shuffles), rows
//! repeating a recent value, rows whose value grows (bounds galloped from the row before) or
//! drops, and tiles sharing one bitmask because their features are equal up to a shift.

use rand::{Rng, SeedableRng};
use tessera_mask::{BandFeatures, Mask, SegmentIds};
use tessera_plan::{build_plan, PlanShape, TileShape};

fn band(q: &[i64], kv: &[i64], lo: i64, hi: i64) -> Mask {
    let q = SegmentIds::new(1, q.len(), q.to_vec()).unwrap();
    let kv = SegmentIds::new(1, kv.len(), kv.to_vec()).unwrap();
    Mask::band(BandFeatures::new("f", q, "g", kv), lo, hi)
}

/// Plans `band(q, kv, lo, hi)` at `tile` and compares every pair and every tile state with
/// the definition `lo <= q[i] - kv[j] <= hi`.
fn check(q: &[i64], kv: &[i64], lo: i64, hi: i64, tile: (usize, usize), what: &str) {
    let (lq, lkv) = (q.len(), kv.len());
    let plan = build_plan(
        &band(q, kv, lo, hi),
        PlanShape::new(1, 1, lq, lkv).unwrap(),
        TileShape::new(tile.0, tile.1).unwrap(),
    )
    .unwrap();
    let allowed = |i: usize, j: usize| {
        let d = q[i] as i128 - kv[j] as i128;
        lo as i128 <= d && d <= hi as i128
    };
    let (dims, states) = plan.states();
    let (nq, nk) = (dims[2], dims[3]);
    for qt in 0..nq {
        for kt in 0..nk {
            let (mut any, mut all) = (false, true);
            for i in qt * tile.0..((qt + 1) * tile.0).min(lq) {
                for j in kt * tile.1..((kt + 1) * tile.1).min(lkv) {
                    let a = allowed(i, j);
                    assert_eq!(plan.allowed(0, 0, i, j), a, "{what}: pair ({i}, {j})");
                    any |= a;
                    all &= a;
                }
            }
            let want = if all {
                2
            } else if any {
                1
            } else {
                0
            };
            assert_eq!(states[qt * nk + kt], want, "{what}: tile ({qt}, {kt})");
        }
    }
}

const TILES: &[(usize, usize)] = &[(16, 16), (32, 64), (64, 32), (128, 128)];

/// NATTEN's window start along one axis: `clamp(x // d - k // 2, 0, lg - k)` in the
/// coordinate's dilation group (of `lg` positions).
fn natten_start(x: i64, n: i64, k: i64, d: i64) -> i64 {
    let lg = n / d + i64::from(x % d < n % d);
    (x / d - k / 2).clamp(0, lg - k)
}

#[test]
fn natten_axes_row_major_and_tiled() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(71);
    for _ in 0..6 {
        let (h, w) = (rng.gen_range(3..40i64), rng.gen_range(3..40i64));
        let d = rng.gen_range(1..=3i64).min(w);
        let k = rng.gen_range(1..=w / d);
        // Canvas cells in row-major order, or stored in tiles of th x tw.
        let (th, tw) = (rng.gen_range(1..=4i64), rng.gen_range(1..=4i64));
        let tiled = h % th == 0 && w % tw == 0 && rng.gen_bool(0.5);
        let cells: Vec<(i64, i64)> = (0..h * w)
            .map(|t| {
                if !tiled {
                    return (t / w, t % w);
                }
                let (tile, inside) = (t / (th * tw), t % (th * tw));
                let (tr, tc) = (tile / (w / tw), tile % (w / tw));
                (tr * th + inside / tw, tc * tw + inside % tw)
            })
            .collect();
        let start: Vec<i64> = cells
            .iter()
            .map(|&(_, c)| natten_start(c, w, k, d))
            .collect();
        let col: Vec<i64> = cells.iter().map(|&(_, c)| c / d).collect();
        let group: Vec<i64> = cells.iter().map(|&(r, c)| (r % 2) * d + c % d).collect();
        let tile = TILES[rng.gen_range(0..TILES.len())];
        let what = format!("{h}x{w} k={k} d={d} tiled={tiled}");
        check(&start, &col, -(k - 1), 0, tile, &format!("{what} window"));
        check(&group, &group, 0, 0, tile, &format!("{what} groups"));
    }
}

#[test]
fn positions_in_repeating_frames_and_flags() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(72);
    for _ in 0..6 {
        let (prompt, per, frames) = (
            rng.gen_range(0..40i64),
            rng.gen_range(5..90i64),
            rng.gen_range(2..6i64),
        );
        let n = prompt + per * frames;
        let pos: Vec<i64> = (0..n).map(|i| (i - prompt).rem_euclid(per)).collect();
        let w = rng.gen_range(0..per);
        let tile = TILES[rng.gen_range(0..TILES.len())];
        check(
            &pos,
            &pos,
            -w,
            w,
            tile,
            &format!("frames p={prompt} per={per} w={w}"),
        );
        // Global rows and columns: flags q and -flags kv, allowed when the sum is 1 or 2.
        let flags: Vec<i64> = (0..n).map(|_| i64::from(rng.gen_bool(0.1))).collect();
        let neg: Vec<i64> = flags.iter().map(|f| -f).collect();
        check(&flags, &neg, 1, 2, tile, "global flags");
    }
}

#[test]
fn residues_and_rising_rows_over_shuffled_keys() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(73);
    for _ in 0..6 {
        let n = rng.gen_range(50..400usize);
        let d = rng.gen_range(1..12i64);
        let res: Vec<i64> = (0..n as i64).map(|i| i % d).collect();
        let tile = TILES[rng.gen_range(0..TILES.len())];
        check(&res, &res, 0, 0, tile, &format!("residues mod {d}"));
        // Rising query values (steps of 0 to 3) against shuffled keys (rows built key by key)
        // and against the same keys sorted (bounds galloped from the row before).
        let mut v = 0;
        let rising: Vec<i64> = (0..n)
            .map(|_| {
                v += rng.gen_range(0..4);
                v
            })
            .collect();
        let keys: Vec<i64> = (0..n).map(|_| rng.gen_range(0..v + 1)).collect();
        let (lo, hi) = (rng.gen_range(-20..5), rng.gen_range(5..30));
        check(
            &rising,
            &keys,
            lo,
            hi,
            tile,
            &format!("rising vs shuffled [{lo}, {hi}]"),
        );
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        let what = format!("rising vs sorted [{lo}, {hi}]");
        check(&rising, &sorted, lo, hi, tile, &what);
    }
}
