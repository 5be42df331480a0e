//! Writes the verification cases of `bench/check_exports.py`: for each case, the dense token
//! mask (`NAME.dense.npy`, bool `[B', H, Lq, Lkv]`), the Splash export (`NAME.splash.npz`) and
//! the Flex export (`NAME.flex.npz`), plus `cases.json` describing them.
//!
//! `cargo run --release -p tessera-export --example export_cases -- OUTDIR`

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use tessera_export::npz::NpyArray;
use tessera_export::{flex, splash, SplashOptions};
use tessera_mask::{DenseMask, Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, PlanShape, TileShape};

struct Case {
    name: &'static str,
    mask: Mask,
    shape: (usize, usize, usize, usize),
    tile: (usize, usize),
    splash: SplashOptions,
}

/// Deterministic xorshift stream.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn docs(rng: &mut Rng, len: usize, mean: u64, pad_tail: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(len);
    let mut id = 0i64;
    while ids.len() < len - pad_tail {
        let n = (1 + rng.below(2 * mean)) as usize;
        for _ in 0..n.min(len - pad_tail - ids.len()) {
            ids.push(id);
        }
        id += 1;
    }
    ids.resize(len, -1);
    ids
}

fn seg(ids: Vec<i64>) -> Arc<Segments> {
    Segments::shared(SegmentIds::shared(ids).expect("segment ids"))
}

fn dense(rng: &mut Rng, shape: &[usize], block: usize, label: &str) -> DenseMask {
    // Random block structure (empty / full / random) so that all tile states occur.
    let (lq, lkv) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    let slices: usize = shape[..shape.len() - 2].iter().product();
    let mut v = vec![false; slices * lq * lkv];
    for s in 0..slices {
        let nbq = lq.div_ceil(block);
        let nbk = lkv.div_ceil(block);
        let kinds: Vec<u64> = (0..nbq * nbk).map(|_| rng.below(4)).collect();
        for i in 0..lq {
            for j in 0..lkv {
                let k = kinds[(i / block) * nbk + j / block];
                v[(s * lq + i) * lkv + j] = match k {
                    0 => false,
                    1 => true,
                    2 => rng.below(8) != 0,
                    _ => rng.below(3) == 0,
                };
            }
        }
    }
    DenseMask::new(shape, &v, label).expect("dense mask")
}

fn opts(head_shards: usize, q_seq_shards: usize, shrink_dkv: bool) -> SplashOptions {
    SplashOptions {
        head_shards,
        q_seq_shards,
        shrink_grid_dkv: shrink_dkv,
        ..SplashOptions::default()
    }
}

fn cases() -> Vec<Case> {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let d = SplashOptions::default();
    let mut v = vec![
        Case {
            name: "causal_1024_t128",
            mask: Mask::causal(),
            shape: (1, 1, 1024, 1024),
            tile: (128, 128),
            splash: d,
        },
        Case {
            name: "causal_ragged_1000_t128x64",
            mask: Mask::causal(),
            shape: (1, 2, 1000, 1000),
            tile: (128, 64),
            splash: d,
        },
        Case {
            name: "causal_offset_cross_384x640",
            mask: Mask::causal_offset(256),
            shape: (1, 1, 384, 640),
            tile: (128, 128),
            splash: d,
        },
        Case {
            name: "local_window100_1024_t64",
            mask: Mask::window(100, 0),
            shape: (1, 1, 1024, 1024),
            tile: (64, 64),
            splash: d,
        },
        Case {
            name: "local_window64_32_ragged777_t128",
            mask: Mask::window(64, 32),
            shape: (1, 1, 777, 777),
            tile: (128, 128),
            splash: d,
        },
        Case {
            name: "chunked_causal_200_1024_t128x64",
            mask: Mask::chunk(200) & Mask::causal(),
            shape: (1, 1, 1024, 1024),
            tile: (128, 64),
            splash: d,
        },
        Case {
            name: "chunk_256_bidir_1024_t128",
            mask: Mask::chunk(256),
            shape: (1, 1, 1024, 1024),
            tile: (128, 128),
            splash: d,
        },
        Case {
            name: "prefix_lm_100_512_t64",
            mask: Mask::causal() | Mask::prefix(100),
            shape: (1, 1, 512, 512),
            tile: (64, 64),
            splash: d,
        },
        Case {
            name: "causal_not_window16_512_t32",
            mask: Mask::causal() & !Mask::window(16, 0),
            shape: (1, 1, 512, 512),
            tile: (32, 32),
            splash: d,
        },
        Case {
            name: "heads_mixed_4_512_t64",
            mask: Mask::heads(vec![
                Mask::causal(),
                Mask::window(40, 0),
                Mask::causal() & Mask::full(),
                Mask::chunk(96) & Mask::causal(),
            ]),
            shape: (1, 4, 512, 512),
            tile: (64, 64),
            splash: d,
        },
        Case {
            name: "heads_mixed_sharded_h2_q2",
            mask: Mask::heads(vec![
                Mask::causal(),
                Mask::window(40, 0),
                Mask::causal() & Mask::full(),
                Mask::chunk(96) & Mask::causal(),
            ]),
            shape: (1, 4, 512, 512),
            tile: (64, 64),
            splash: opts(2, 2, true),
        },
        Case {
            name: "heads_pairs_sharded_h2",
            mask: Mask::heads(vec![
                Mask::causal(),
                Mask::causal(),
                Mask::window(40, 0),
                Mask::window(40, 0),
            ]),
            shape: (1, 4, 512, 512),
            tile: (64, 64),
            splash: opts(2, 1, true),
        },
        Case {
            name: "causal_sharded_h2_q4",
            mask: Mask::causal(),
            shape: (1, 4, 1024, 1024),
            tile: (128, 64),
            splash: opts(2, 4, true),
        },
        Case {
            name: "window_q2_noshrink_dkv",
            mask: Mask::window(150, 20),
            shape: (1, 2, 1024, 1024),
            tile: (64, 128),
            splash: opts(1, 2, false),
        },
    ];
    let ids = docs(&mut rng, 2048, 300, 0);
    v.push(Case {
        name: "documents_causal_2048_t128",
        mask: Mask::causal() & Mask::document(seg(ids)),
        shape: (1, 1, 2048, 2048),
        tile: (128, 128),
        splash: d,
    });
    let ids = docs(&mut rng, 1000, 150, 37);
    v.push(Case {
        name: "documents_padded_ragged_1000_t64",
        mask: Mask::document(seg(ids)) & Mask::causal(),
        shape: (1, 2, 1000, 1000),
        tile: (64, 64),
        splash: d,
    });
    let mut rows = docs(&mut rng, 768, 120, 0);
    rows.extend(docs(&mut rng, 768, 200, 50));
    let per_row = Segments::shared(SegmentIds::new(2, 768, rows).expect("ids"));
    v.push(Case {
        name: "documents_per_row_b2_768_t64",
        mask: Mask::document(per_row) & Mask::causal(),
        shape: (2, 2, 768, 768),
        tile: (64, 64),
        splash: d,
    });
    v.push(Case {
        name: "dense_random_h3_256_t32",
        mask: Mask::dense(dense(&mut rng, &[3, 256, 256], 32, "r1")),
        shape: (1, 3, 256, 256),
        tile: (32, 32),
        splash: d,
    });
    v.push(Case {
        name: "dense_random_ragged_200x300_t32x64",
        mask: Mask::dense(dense(&mut rng, &[200, 300], 16, "r2")),
        shape: (1, 1, 200, 300),
        tile: (32, 64),
        splash: d,
    });
    v.push(Case {
        name: "dense_and_causal_or_window_h2_384_t64",
        mask: (Mask::dense(dense(&mut rng, &[2, 384, 384], 64, "r3")) & Mask::causal())
            | Mask::window(8, 8),
        shape: (1, 2, 384, 384),
        tile: (64, 64),
        splash: d,
    });
    let one = dense(&mut rng, &[1, 256, 256], 32, "r4");
    let mut same = Vec::new();
    for _ in 0..4 {
        for i in 0..256 {
            for j in 0..256 {
                same.push(one.get(0, i, j));
            }
        }
    }
    v.push(Case {
        name: "dense_identical_heads_h4_256_t32",
        mask: Mask::dense(DenseMask::new(&[4, 256, 256], &same, "r5").expect("dense")),
        shape: (1, 4, 256, 256),
        tile: (32, 32),
        splash: d,
    });
    v.push(Case {
        name: "dense_identical_heads_sharded_h2_q2",
        mask: Mask::dense(DenseMask::new(&[4, 256, 256], &same, "r5").expect("dense")),
        shape: (1, 4, 256, 256),
        tile: (32, 32),
        splash: opts(2, 2, true),
    });
    let ids = docs(&mut rng, 1024, 200, 0);
    v.push(Case {
        name: "documents_and_window_or_prefix_1024_t64x128",
        mask: (Mask::document(seg(ids)) & Mask::window(128, 0)) | Mask::prefix(64),
        shape: (1, 1, 1024, 1024),
        tile: (64, 128),
        splash: d,
    });
    v.push(Case {
        name: "full_256_t64",
        mask: Mask::full(),
        shape: (1, 1, 256, 256),
        tile: (64, 64),
        splash: d,
    });
    v.push(Case {
        name: "full_ragged_100x130_t32",
        mask: Mask::full(),
        shape: (1, 1, 100, 130),
        tile: (32, 32),
        splash: d,
    });
    v
}

/// Random mask trees over all leaf kinds, random shapes, tiles and Splash options.
fn random_cases(n: usize) -> Vec<Case> {
    let mut rng = Rng(0x0dd_ba11_cafe_f00d);
    let names: Vec<&'static str> = (0..n)
        .map(|k| &*Box::leak(format!("random_{k:03}").into_boxed_str()))
        .collect();
    let mut out = Vec::new();
    for name in names {
        let b = 1 + rng.below(2) as usize;
        let h = 1 + rng.below(4) as usize;
        let tq = 16 << rng.below(3);
        let tk = 16 << rng.below(3);
        let lq = if rng.below(2) == 0 {
            tq * (1 + rng.below(8) as usize)
        } else {
            1 + rng.below(300) as usize
        };
        let lkv = if rng.below(3) == 0 {
            lq
        } else if rng.below(2) == 0 {
            tk * (1 + rng.below(8) as usize)
        } else {
            1 + rng.below(300) as usize
        };
        let mask = random_tree(&mut rng, 3, b, h, lq, lkv);
        let mask = if h > 1 && rng.below(4) == 0 {
            let mut v: Vec<Mask> = (0..h)
                .map(|_| random_tree(&mut rng, 2, b, h, lq, lkv))
                .collect();
            v[h - 1] = v[0].clone();
            Mask::heads(v)
        } else {
            mask
        };
        let nq = lq.div_ceil(tq);
        let divisors = |x: usize| (1..=x).filter(|d| x % d == 0).collect::<Vec<_>>();
        let hsd = divisors(h);
        let qsd = divisors(nq);
        let splash = SplashOptions {
            head_shards: hsd[rng.below(hsd.len() as u64) as usize],
            q_seq_shards: qsd[rng.below(qsd.len().min(3) as u64) as usize],
            shrink_grid: rng.below(4) != 0,
            shrink_grid_dkv: rng.below(3) != 0,
            downcast_smem_data: rng.below(5) != 0,
        };
        out.push(Case {
            name,
            mask,
            shape: (b, h, lq, lkv),
            tile: (tq, tk),
            splash,
        });
    }
    out
}

fn random_tree(rng: &mut Rng, depth: usize, b: usize, h: usize, lq: usize, lkv: usize) -> Mask {
    if depth == 0 || rng.below(3) == 0 {
        let lmax = lq.max(lkv) as u64;
        return match rng.below(8) {
            0 => Mask::causal_offset(rng.below(lmax / 2 + 1) as i64 - (lmax / 4) as i64),
            1 => Mask::causal(),
            2 => Mask::window(
                rng.below(lmax / 2 + 1) as i64,
                rng.below(lmax / 8 + 1) as i64,
            ),
            3 => Mask::chunk(1 + rng.below(lmax)),
            4 => Mask::prefix(rng.below(lkv as u64 + 1)),
            5 | 6 => {
                let rows = if b > 1 && rng.below(2) == 0 { b } else { 1 };
                let mut q = Vec::new();
                let mut kv = Vec::new();
                for _ in 0..rows {
                    let pad = rng.below(1 + lq as u64 / 8) as usize;
                    q.extend(docs(rng, lq, 1 + lq as u64 / 4, pad));
                    kv.extend(docs(rng, lkv, 1 + lkv as u64 / 4, 0));
                }
                let q = SegmentIds::new(rows, lq, q).expect("ids");
                if lq == lkv && rng.below(3) != 0 {
                    Mask::document(Segments::shared(q))
                } else {
                    let kv = SegmentIds::new(rows, lkv, kv).expect("ids");
                    Mask::document(Segments::cross(q, kv).expect("cross"))
                }
            }
            _ => {
                let shape = match rng.below(3) {
                    0 => vec![lq, lkv],
                    1 => vec![h, lq, lkv],
                    _ => vec![b, h, lq, lkv],
                };
                let blk = 8 << rng.below(3);
                Mask::dense(dense(rng, &shape, blk, "rand"))
            }
        };
    }
    match rng.below(5) {
        0 | 1 => {
            random_tree(rng, depth - 1, b, h, lq, lkv) & random_tree(rng, depth - 1, b, h, lq, lkv)
        }
        2 | 3 => {
            random_tree(rng, depth - 1, b, h, lq, lkv) | random_tree(rng, depth - 1, b, h, lq, lkv)
        }
        _ => !random_tree(rng, depth - 1, b, h, lq, lkv),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: export_cases OUTDIR [RANDOM_CASES (default 60)]";
    let out: PathBuf = std::env::args().nth(1).ok_or(usage)?.into();
    let n_random: usize = std::env::args()
        .nth(2)
        .map_or(Ok(60), |s| s.parse())
        .map_err(|_| usage)?;
    std::fs::create_dir_all(&out)?;
    let mut json = String::from("[\n");
    let mut cases = cases();
    cases.extend(random_cases(n_random));
    for (n, c) in cases.iter().enumerate() {
        let (b, h, lq, lkv) = c.shape;
        let plan = build_plan(
            &c.mask,
            PlanShape::new(b, h, lq, lkv)?,
            TileShape::new(c.tile.0, c.tile.1)?,
        )?;
        let (bg, hg) = (plan.batch_groups, plan.head_groups);
        let mut bits = Vec::with_capacity(bg * h * lq * lkv);
        for bb in 0..bg {
            for hh in 0..h {
                for i in 0..lq {
                    for j in 0..lkv {
                        bits.push(c.mask.allowed(bb, hh, i, j));
                    }
                }
            }
        }
        let dense = NpyArray::from_bools(vec![bg, h, lq, lkv], &bits);
        tessera_io::atomic_write_bytes(
            &out.join(format!("{}.dense.npy", c.name)),
            &dense.to_npy(),
        )?;
        // An error here is what JAX does too (process_mask asserts on an empty shrunk grid):
        // the checker expects the reference to fail when the case says so.
        let splash_error = match splash::export_with(&plan, &c.splash) {
            Ok(s) => {
                s.write_npz(&out.join(format!("{}.splash.npz", c.name)))?;
                false
            }
            Err(e) => {
                eprintln!("{}: splash export refused: {e}", c.name);
                true
            }
        };
        flex::export(&plan)?.write_npz(&out.join(format!("{}.flex.npz", c.name)))?;
        let o = &c.splash;
        writeln!(
            json,
            "  {{\"name\": \"{}\", \"mask\": \"{}\", \"B\": {b}, \"H\": {h}, \"Lq\": {lq}, \"Lkv\": {lkv}, \
             \"tile\": [{}, {}], \"batch_groups\": {bg}, \"head_groups\": {hg}, \"head_shards\": {}, \
             \"q_seq_shards\": {}, \"shrink_grid\": {}, \"shrink_grid_dkv\": {}, \"downcast\": {}, \
             \"splash_error\": {splash_error}}}{}",
            c.name,
            c.mask.to_string().replace('"', "'"),
            c.tile.0,
            c.tile.1,
            o.head_shards,
            o.q_seq_shards,
            o.shrink_grid,
            o.shrink_grid_dkv,
            o.downcast_smem_data,
            if n + 1 < cases.len() { "," } else { "" }
        )?;
        eprintln!(
            "{}: B'={bg} H'={hg} partial masks {}",
            c.name,
            plan.partials.len()
        );
    }
    json.push_str("]\n");
    tessera_io::atomic_write_bytes(&out.join("cases.json"), json.as_bytes())?;
    println!("{} cases written to {}", cases.len(), out.display());
    Ok(())
}
