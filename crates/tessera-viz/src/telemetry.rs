//! The telemetry picture of one layer: sink mass as a head × step heatmap and max_logit per
//! head over steps.

use crate::canvas::{colour_map, nice_ticks, number_label, tick_label, Align, Canvas, AXIS, INK};
use embedded_graphics::mono_font::ascii::{FONT_7X13, FONT_7X13_BOLD};
use tessera_core::{Error, Result};
use tessera_telemetry::TelemetryRecord;

pub(crate) const GRID: [u8; 3] = [228, 228, 228];
pub(crate) const NO_DATA: [u8; 3] = [205, 205, 205];

/// Distinct line colours (Tableau 20 order: the 10 strong colours first).
#[rustfmt::skip]
const HEAD_COLOURS: [[u8; 3]; 20] = [
    [31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189],
    [140, 86, 75], [227, 119, 194], [127, 127, 127], [188, 189, 34], [23, 190, 207],
    [174, 199, 232], [255, 187, 120], [152, 223, 138], [255, 152, 150], [197, 176, 213],
    [196, 156, 148], [247, 182, 210], [199, 199, 199], [219, 219, 141], [158, 218, 229],
];

/// Most heads a telemetry picture draws (one heatmap row each).
pub const MAX_PLOT_HEADS: usize = 1024;

/// Colour of head `h` in line charts.
pub(crate) fn head_colour(h: usize) -> [u8; 3] {
    HEAD_COLOURS[h % HEAD_COLOURS.len()]
}

/// Mean of the finite values, `None` if there are none.
pub(crate) fn mean_defined(vals: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let (mut s, mut n) = (0.0, 0usize);
    for v in vals.flatten().filter(|v| v.is_finite()) {
        s += v;
        n += 1;
    }
    (n > 0).then(|| s / n as f64)
}

/// Checks that `records` can be drawn: at least one, all with the same 1 to
/// [`MAX_PLOT_HEADS`] heads. Returns the head count.
pub(crate) fn check(records: &[TelemetryRecord]) -> Result<usize> {
    let Some(first) = records.first() else {
        return Err(Error::invalid(
            "telemetry records",
            "at least one record",
            "none",
        ));
    };
    let heads = first.heads();
    if let Some(r) = records.iter().find(|r| r.heads() != heads) {
        return Err(Error::invalid(
            "telemetry records",
            format!("{heads} heads in every record (as step {})", first.step),
            format!("{} heads at step {}", r.heads(), r.step),
        ));
    }
    if heads == 0 || heads > MAX_PLOT_HEADS {
        return Err(Error::invalid(
            "telemetry records",
            format!("1 to {MAX_PLOT_HEADS} heads to plot"),
            heads,
        ));
    }
    Ok(heads)
}

/// Every how many records a step tick goes (1, 2, 5, 10, 20, ...) so that `n` labels of steps up
/// to `s0`/`s1` fit in `plot_w` pixels at `fw` pixels a character.
pub(crate) fn step_stride(n: usize, plot_w: i32, fw: i32, s0: u64, s1: u64) -> usize {
    let label_w = fw * (s1.to_string().len().max(s0.to_string().len()) as i32) + 14;
    let max_ticks = (plot_w / label_w).max(1) as usize;
    let mut pow = 1usize;
    loop {
        for m in [1usize, 2, 5] {
            if n.div_ceil(m * pow) <= max_ticks {
                return m * pow;
            }
        }
        pow *= 10;
    }
}

/// The telemetry of one layer as a PNG: `records` sorted by step, all with the same head count.
///
/// Top panel: sink mass as a head × step heatmap (colour bar with min/max labels; grey = no
/// data); bottom panel: max_logit per head over steps (one colour per head, legend on the
/// right). More steps than pixel columns are averaged per column.
pub fn telemetry_png(records: &[TelemetryRecord], title: &str) -> Result<Vec<u8>> {
    let heads = check(records)?;
    let (first, n) = (&records[0], records.len());
    let (fw, fh) = (7i32, 13i32);
    let small = &FONT_7X13;
    let bold = &FONT_7X13_BOLD;

    // Geometry.
    let plot_w: i32 = 760;
    let x0: i32 = 86;
    let cell_h: i32 = (320 / heads as i32).clamp(3, 40);
    let heat_h = cell_h * heads as i32;
    let heat_y = 86;
    // The colour bar (and its "no data" key below) may be taller than a short heatmap.
    let bar_h = heat_h.max(80);
    let line_y = heat_y + (heat_h + 86).max(bar_h + 30 + 52);
    let line_h = 280;
    let legend_x = x0 + plot_w + 26;
    // Legend: every head up to 40 (two columns past 20); beyond, the 20 colours that repeat.
    let legend_entries = if heads <= 40 {
        heads
    } else {
        HEAD_COLOURS.len()
    };
    let legend_cols = if legend_entries <= 20 { 1 } else { 2 };
    let per_col = legend_entries.div_ceil(legend_cols);
    let width = (legend_x + 56 * legend_cols as i32 + 100).max(x0 + plot_w + 140) as u32;
    let height = (line_y + line_h + 62).max(line_y + per_col as i32 * 14 + 60) as u32;
    let mut c = Canvas::new(width, height);

    // Columns: one per record, or records averaged per pixel column.
    let ncols = n.min(plot_w as usize);
    let col_x = |k: usize| x0 + (k as i64 * plot_w as i64 / ncols as i64) as i32;
    let col_records = |k: usize| (k * n / ncols)..((k + 1) * n / ncols).max(k * n / ncols + 1);
    let record_x = |i: usize| x0 + (((i as f64 + 0.5) / n as f64) * plot_w as f64) as i32;

    // Title.
    c.title(x0, 12, title);
    let (s0, s1) = (first.step, records[n - 1].step);
    c.text(
        x0,
        38,
        &format!(
            "layer {}  |  {heads} head{}  |  {n} logged step{} ({s0} .. {s1}){}",
            first.layer,
            if heads == 1 { "" } else { "s" },
            if n == 1 { "" } else { "s" },
            if ncols < n {
                "  |  each column averages several steps"
            } else {
                ""
            }
        ),
        small,
        AXIS,
        Align::Left,
    );

    // X ticks (shared by both panels).
    let ticks: Vec<usize> = (0..n).step_by(step_stride(n, plot_w, fw, s0, s1)).collect();
    let draw_x_axis = |c: &mut Canvas, y_bottom: i32| {
        for &i in &ticks {
            let x = record_x(i);
            c.line((x, y_bottom + 1), (x, y_bottom + 5), AXIS, 1);
            let step = records[i].step.to_string();
            c.text(x, y_bottom + 8, &step, small, INK, Align::Centre);
        }
        let y = y_bottom + 8 + fh + 6;
        c.text(x0 + plot_w / 2 - 2 * fw, y, "step", bold, INK, Align::Left);
    };
    // A panel's heading above it and its axis name above the y tick labels.
    let headings = |c: &mut Canvas, y: i32, heading: &str, axis: &str| {
        c.text(x0, y - 26, heading, bold, INK, Align::Left);
        c.text(x0 - 9, y - 14, axis, bold, INK, Align::Right);
    };
    let no_data = |c: &mut Canvas, y: i32, h: i32, what: &str| {
        c.text(
            x0 + plot_w / 2,
            y + h / 2 - fh / 2,
            what,
            small,
            INK,
            Align::Centre,
        );
    };
    // A y tick at `y` labelled `label`.
    let y_tick = |c: &mut Canvas, y: i32, label: &str| {
        c.line((x0 - 6, y), (x0 - 2, y), AXIS, 1);
        c.text(x0 - 9, y - fh / 2, label, small, INK, Align::Right);
    };

    // Panel 1: sink-mass heatmap.
    headings(&mut c, heat_y, "sink mass (mean over valid rows)", "head");
    let sink = |r: &TelemetryRecord, h: usize| -> Option<f64> {
        r.sink_mass
            .as_ref()
            .and_then(|v| v.get(h).copied().flatten())
    };
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for r in records {
        for v in (0..heads)
            .filter_map(|h| sink(r, h))
            .filter(|v| v.is_finite())
        {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    let have_sink = lo <= hi;
    let (lo_s, hi_s) = if !have_sink {
        (0.0, 1.0)
    } else if hi - lo < 1e-12 {
        ((lo - 0.05).max(0.0), (hi + 0.05).min(1.0).max(lo + 1e-6))
    } else {
        (lo, hi)
    };
    for k in 0..ncols {
        let (xa, xb) = (col_x(k), col_x(k + 1));
        for h in 0..heads {
            let v = mean_defined(col_records(k).map(|i| sink(&records[i], h)));
            let colour = v.map_or(NO_DATA, |v| colour_map((v - lo_s) / (hi_s - lo_s)));
            let y = heat_y + h as i32 * cell_h;
            c.rect(xa, y, (xb - xa).max(1), cell_h, colour);
        }
    }
    c.frame(x0, heat_y, plot_w, heat_h, AXIS);
    if !have_sink {
        no_data(
            &mut c,
            heat_y,
            heat_h,
            "no sink-mass data (sink stream off?)",
        );
    }
    // Head ticks.
    let head_stride = {
        let need = ((fh + 2 + cell_h - 1) / cell_h).max(1) as usize;
        [1usize, 2, 4, 5, 8, 10, 16, 20, 32, 50, 64, 100]
            .into_iter()
            .find(|s| *s >= need)
            .unwrap_or(need)
    };
    for h in (0..heads).step_by(head_stride) {
        y_tick(
            &mut c,
            heat_y + h as i32 * cell_h + cell_h / 2,
            &h.to_string(),
        );
    }
    draw_x_axis(&mut c, heat_y + heat_h);
    // Colour bar.
    let bar_w = 18;
    for yy in 0..bar_h {
        let t = 1.0 - yy as f64 / (bar_h - 1).max(1) as f64;
        c.rect(legend_x, heat_y + yy, bar_w, 1, colour_map(t));
    }
    c.frame(legend_x, heat_y, bar_w, bar_h, AXIS);
    let bar_label = |c: &mut Canvas, y: i32, text: String| {
        c.text(legend_x + bar_w + 6, y, &text, small, INK, Align::Left);
    };
    bar_label(&mut c, heat_y - 2, format!("max {}", number_label(hi_s)));
    bar_label(
        &mut c,
        heat_y + bar_h - fh + 2,
        format!("min {}", number_label(lo_s)),
    );
    c.rect(legend_x, heat_y + bar_h + 10, 12, 12, NO_DATA);
    let y = heat_y + bar_h + 10;
    c.text(legend_x + 16, y, "no data", small, AXIS, Align::Left);

    // Panel 2: max_logit lines.
    headings(
        &mut c,
        line_y,
        "max_logit (pre-softcap) per head",
        "max_logit",
    );
    let series: Vec<Vec<Option<f64>>> = (0..heads)
        .map(|h| {
            (0..ncols)
                .map(|k| mean_defined(col_records(k).map(|i| records[i].max_logit[h])))
                .collect()
        })
        .collect();
    let thick = if heads <= 8 { 2 } else { 1 };
    let cx = |k: usize| (col_x(k) + col_x(k + 1)) / 2;
    let panel = Panel {
        x0,
        y: line_y,
        w: plot_w,
        h: line_h,
    };
    line_panel(
        &mut c,
        panel,
        &series,
        cx,
        thick,
        ncols <= 40,
        "no max_logit data",
    );
    draw_x_axis(&mut c, line_y + line_h);
    // Head legend.
    c.text(legend_x, line_y - 14, "heads", bold, INK, Align::Left);
    for h in 0..legend_entries {
        let lx = legend_x + 56 * (h / per_col) as i32;
        let ly = line_y + (h % per_col) as i32 * (fh + 1);
        c.rect(lx, ly + 3, 14, 7, head_colour(h));
        c.text(lx + 18, ly, &format!("h{h}"), small, INK, Align::Left);
    }
    if legend_entries < heads {
        let ly = line_y + per_col as i32 * (fh + 1) + 4;
        let n = HEAD_COLOURS.len();
        c.text(legend_x, ly, "colours repeat", small, AXIS, Align::Left);
        let every = format!("every {n} heads");
        c.text(legend_x, ly + fh, &every, small, AXIS, Align::Left);
    }
    c.png()
}

/// Where a panel sits on the canvas.
#[derive(Clone, Copy)]
pub(crate) struct Panel {
    pub(crate) x0: i32,
    pub(crate) y: i32,
    pub(crate) w: i32,
    pub(crate) h: i32,
}

/// A line chart panel: y range from the defined values (padded 6 %), grid and tick labels, the
/// frame, and one polyline per series in [`head_colour`] order at x `cx(k)` for column `k`
/// (isolated points as dots, every point marked when `markers`); `empty` is written when no
/// series has a value.
pub(crate) fn line_panel(
    c: &mut Canvas,
    p: Panel,
    series: &[Vec<Option<f64>>],
    cx: impl Fn(usize) -> i32,
    thick: u32,
    markers: bool,
    empty: &str,
) {
    let fh = 13i32;
    let (mut ylo, mut yhi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in series.iter().flatten().flatten() {
        ylo = ylo.min(*v);
        yhi = yhi.max(*v);
    }
    let have = ylo <= yhi;
    if !have {
        (ylo, yhi) = (0.0, 1.0);
    } else if yhi - ylo < 1e-9 {
        (ylo, yhi) = (ylo - 0.5, yhi + 0.5);
    } else {
        let pad = 0.06 * (yhi - ylo);
        (ylo, yhi) = (ylo - pad, yhi + pad);
    }
    let y_of = |v: f64| p.y + p.h - 1 - ((v - ylo) / (yhi - ylo) * (p.h - 1) as f64).round() as i32;
    let yticks = nice_ticks(ylo, yhi, 6);
    let tick_step = if yticks.len() >= 2 {
        yticks[1] - yticks[0]
    } else {
        1.0
    };
    for &t in &yticks {
        let y = y_of(t);
        c.line((p.x0, y), (p.x0 + p.w - 1, y), GRID, 1);
        c.line((p.x0 - 6, y), (p.x0 - 2, y), AXIS, 1);
        let label = tick_label(t, tick_step);
        c.text(p.x0 - 9, y - fh / 2, &label, &FONT_7X13, INK, Align::Right);
    }
    c.frame(p.x0, p.y, p.w, p.h, AXIS);
    if !have {
        let (x, y) = (p.x0 + p.w / 2, p.y + p.h / 2 - fh / 2);
        c.text(x, y, empty, &FONT_7X13, INK, Align::Centre);
    }
    for (h, s) in series.iter().enumerate() {
        let colour = head_colour(h);
        let mut prev: Option<(i32, i32)> = None;
        for (k, v) in s.iter().enumerate() {
            let Some(v) = v else {
                prev = None;
                continue;
            };
            let pt = (cx(k), y_of(*v));
            if let Some(q) = prev {
                c.line(q, pt, colour, thick);
            } else if s.get(k + 1).is_none_or(|nv| nv.is_none()) {
                // An isolated point: a dot, so it is visible without a neighbour.
                c.rect(pt.0 - 1, pt.1 - 1, 3, 3, colour);
            }
            if markers {
                c.rect(pt.0 - 2, pt.1 - 2, 5, 5, colour);
            }
            prev = Some(pt);
        }
    }
}
