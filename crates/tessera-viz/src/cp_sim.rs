//! The `tessera cp-sim` chart: largest over mean per-rank cost of every scheme, one panel per row
//! length, one bar group per world size.

use crate::canvas::{nice_ticks, tick_label, Align, Canvas, AXIS, INK};
use embedded_graphics::mono_font::ascii::FONT_7X13;
use tessera_core::{Error, Result};
use tessera_plan::cp_sim::SimRow;
use tessera_plan::Scheme;

const GRID: [u8; 3] = [228, 228, 228];
const SCHEME_COLOURS: [[u8; 3]; 4] = [
    [127, 127, 127],
    [255, 127, 14],
    [44, 160, 44],
    [31, 119, 180],
];

fn tokens_label(n: usize) -> String {
    if n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

/// The chart of `rows` (from `simulate`) as a PNG: per row length a panel of grouped bars
/// (schemes) over world sizes, the height being the largest over mean per-rank modelled cost
/// (1 = perfect balance).
pub fn cp_sim_png(rows: &[SimRow], title: &str) -> Result<Vec<u8>> {
    let mut lengths: Vec<usize> = rows.iter().map(|r| r.tokens).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let mut ranks: Vec<usize> = rows.iter().map(|r| r.ranks).collect();
    ranks.sort_unstable();
    ranks.dedup();
    if lengths.is_empty() || ranks.is_empty() {
        return Err(Error::invalid("rows", "at least one simulated row", 0));
    }
    let ymax = rows
        .iter()
        .map(|r| r.cost_max_over_mean)
        .fold(1.0f64, f64::max)
        .max(1.1);
    let (panel_w, panel_h, x0, top) = (360i32, 300i32, 70i32, 80i32);
    let gap = 40i32;
    let width = (x0 + lengths.len() as i32 * (panel_w + gap) + 20) as u32;
    let height = (top + panel_h + 110) as u32;
    let mut c = Canvas::new(width, height);
    c.title(x0, 12, title);
    c.text(
        x0,
        40,
        "max / mean per-rank cost (forward + backward, tile cost model); lower is better, 1 = even",
        &FONT_7X13,
        AXIS,
        Align::Left,
    );
    let ticks = nice_ticks(0.0, ymax, 6);
    let step = if ticks.len() > 1 {
        ticks[1] - ticks[0]
    } else {
        1.0
    };
    let y_of = |v: f64| top + panel_h - (v / ymax * panel_h as f64) as i32;
    for (p, &n) in lengths.iter().enumerate() {
        let px = x0 + p as i32 * (panel_w + gap);
        for &t in &ticks {
            let y = y_of(t);
            c.line((px, y), (px + panel_w, y), GRID, 1);
            if p == 0 {
                c.text(
                    px - 6,
                    y - 6,
                    &tick_label(t, step),
                    &FONT_7X13,
                    INK,
                    Align::Right,
                );
            }
        }
        let one = y_of(1.0);
        c.line((px, one), (px + panel_w, one), AXIS, 1);
        c.frame(px, top, panel_w, panel_h, AXIS);
        c.text(
            px + panel_w / 2,
            top - 18,
            &format!("N = {} tokens", tokens_label(n)),
            &FONT_7X13,
            INK,
            Align::Centre,
        );
        let group_w = panel_w / ranks.len() as i32;
        let bar_w = (group_w - 12) / Scheme::ALL.len() as i32;
        for (g, &r) in ranks.iter().enumerate() {
            let gx = px + g as i32 * group_w + 6;
            for (k, s) in Scheme::ALL.iter().enumerate() {
                if let Some(row) = rows
                    .iter()
                    .find(|x| x.tokens == n && x.ranks == r && x.scheme == *s)
                {
                    let y = y_of(row.cost_max_over_mean);
                    let x = gx + k as i32 * bar_w;
                    c.rect(x, y, bar_w - 1, top + panel_h - y, SCHEME_COLOURS[k]);
                }
            }
            c.text(
                gx + (group_w - 12) / 2,
                top + panel_h + 6,
                &format!("R={r}"),
                &FONT_7X13,
                INK,
                Align::Centre,
            );
        }
    }
    // Legend.
    let ly = top + panel_h + 34;
    let mut lx = x0;
    for (k, s) in Scheme::ALL.iter().enumerate() {
        c.rect(lx, ly + 2, 12, 12, SCHEME_COLOURS[k]);
        c.text(lx + 18, ly, s.name(), &FONT_7X13, INK, Align::Left);
        lx += 30 + 7 * s.name().len() as i32;
    }
    c.png()
}
