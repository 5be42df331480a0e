//! The tile-state map of one (batch row, head) of a plan.

use crate::canvas::{Align, Canvas, AXIS, INK};
use embedded_graphics::mono_font::ascii::FONT_6X10;
use tessera_core::{Error, Result};
use tessera_plan::Plan;

/// Colour of empty tiles.
const EMPTY: [u8; 3] = [242, 242, 242];
/// Colour of partial tiles.
const PARTIAL: [u8; 3] = [242, 142, 43];
/// Colour of full tiles.
const FULL: [u8; 3] = [47, 93, 140];

/// The tile states of batch row `batch`, head `head` of `plan` as a PNG: rows are query tiles,
/// columns key tiles (empty light grey, partial orange, full blue), downsampled so the map fits
/// in about 900 pixels (each pixel then blends the states it covers) or upsampled up to 24
/// pixels per tile, with `title`, the plan's shape and statistics, and a legend below.
pub fn plan_png(plan: &Plan, batch: usize, head: usize, title: &str) -> Result<Vec<u8>> {
    if batch >= plan.shape.batch {
        return Err(Error::invalid(
            "batch row to draw",
            format!("< {}", plan.shape.batch),
            batch,
        ));
    }
    if head >= plan.shape.heads {
        return Err(Error::invalid(
            "head to draw",
            format!("< {}", plan.shape.heads),
            head,
        ));
    }
    let (nq, nk) = (plan.q_tiles, plan.kv_tiles);
    let max_side = 900usize;
    // Tiles per pixel (downsampling) or pixels per tile (upsampling).
    let tpp = nq.max(nk).div_ceil(max_side).max(1);
    let ppt = if tpp == 1 {
        (max_side / nq.max(nk)).clamp(1, 24)
    } else {
        1
    };
    let (pw, ph) = (nk.div_ceil(tpp), nq.div_ceil(tpp));
    let (mw, mh) = ((pw * ppt) as i32, (ph * ppt) as i32);
    let margin = 20i32;
    let width = (mw + 2 * margin).max(620);
    let height = mh + 2 * margin + 110;
    let mut c = Canvas::new(width as u32, height as u32);
    // Count partial and full tiles per pixel block from the sparse work list.
    let mut counts = vec![[0u32; 2]; pw * ph];
    let hp = plan.head_plan(batch, head);
    for qt in 0..nq {
        for e in hp.row(qt) {
            let cell = &mut counts[(qt / tpp) * pw + e.tile as usize / tpp];
            cell[usize::from(e.is_full())] += 1;
        }
    }
    for py in 0..ph {
        for px in 0..pw {
            let tiles = ((nq - py * tpp).min(tpp) * (nk - px * tpp).min(tpp)) as f32;
            let [p, f] = counts[py * pw + px].map(|n| n as f32);
            let e = tiles - p - f;
            let mix = |k: usize| {
                ((EMPTY[k] as f32 * e + PARTIAL[k] as f32 * p + FULL[k] as f32 * f) / tiles).round()
                    as u8
            };
            let (x, y, side) = (px * ppt, py * ppt, ppt as i32);
            c.rect(
                margin + x as i32,
                margin + y as i32,
                side,
                side,
                [mix(0), mix(1), mix(2)],
            );
        }
    }
    c.frame(margin, margin, mw, mh, AXIS);
    let y0 = margin + mh + 12;
    let s = &plan.stats;
    let small =
        |c: &mut Canvas, y: i32, text: &str| c.text(margin, y, text, &FONT_6X10, INK, Align::Left);
    c.title(margin, y0, title);
    small(
        &mut c,
        y0 + 26,
        &format!(
            "B={} H={} Lq={} Lkv={}  tile {}  grid {}x{}  (batch {batch}, head {head}; rows = queries, cols = keys)",
            plan.shape.batch, plan.shape.heads, plan.shape.q_len, plan.shape.kv_len, plan.tile, nq, nk
        ),
    );
    small(
        &mut c,
        y0 + 40,
        &format!(
            "pair density {:.4}  tile density {:.4}  full {}  partial {} ({} unique)  {}",
            s.density,
            s.tile_density,
            s.full_tiles,
            s.partial_tiles,
            s.unique_partial_masks,
            if tpp > 1 {
                format!("{tpp}x{tpp} tiles per pixel")
            } else {
                format!("{ppt} px per tile")
            }
        ),
    );
    let ly = y0 + 60;
    for (k, (name, col)) in [("empty", EMPTY), ("partial", PARTIAL), ("full", FULL)]
        .into_iter()
        .enumerate()
    {
        let x = margin + 110 * k as i32;
        c.rect(x, ly, 16, 16, col);
        c.rect(x, ly, 16, 1, AXIS);
        c.text(x + 22, ly + 2, name, &FONT_6X10, INK, Align::Left);
    }
    c.png()
}
