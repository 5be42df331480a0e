//! The telemetry overview of a whole model: sink mass per (layer, head) over steps as one
//! heatmap (a block of head rows per layer, one colour scale for all), and the largest
//! max_logit of each layer over steps.

use crate::canvas::{colour_map, number_label, Align, Canvas, AXIS, INK};
use crate::telemetry::{check, head_colour, line_panel, mean_defined, step_stride, Panel, NO_DATA};
use embedded_graphics::mono_font::ascii::{FONT_7X13, FONT_7X13_BOLD};
use std::collections::BTreeMap;
use tessera_core::{Error, Result};
use tessera_telemetry::TelemetryRecord;

/// Most layers the overview draws.
pub const MAX_PLOT_LAYERS: usize = 256;

/// All layers of a run as one PNG: `records` hold one record per (step, layer) (any order; a
/// repeated (step, layer) keeps the last), every layer with the same head count. Top panel:
/// sink mass, rows grouped by layer (grey = no record of that layer at that step); bottom panel:
/// per layer, the largest max_logit over its heads. More steps than pixel columns are averaged
/// per column.
pub fn telemetry_layers_png(records: &[TelemetryRecord], title: &str) -> Result<Vec<u8>> {
    let heads = check(records)?;
    let mut grid: BTreeMap<u32, BTreeMap<u64, &TelemetryRecord>> = BTreeMap::new();
    for r in records {
        grid.entry(r.layer).or_default().insert(r.step, r);
    }
    let layers: Vec<u32> = grid.keys().copied().collect();
    if layers.len() > MAX_PLOT_LAYERS || layers.len() * heads > 4096 {
        return Err(Error::invalid(
            "telemetry records",
            format!("at most {MAX_PLOT_LAYERS} layers and 4096 (layer, head) rows to plot"),
            format!("{} layers of {heads} heads", layers.len()),
        ));
    }
    let steps: Vec<u64> = {
        let mut s: Vec<u64> = records.iter().map(|r| r.step).collect();
        s.sort_unstable();
        s.dedup();
        s
    };
    let (n, nl) = (steps.len(), layers.len());
    let (fw, fh) = (7i32, 13i32);
    let (small, bold) = (&FONT_7X13, &FONT_7X13_BOLD);

    // Geometry: head rows of a layer touch, layers are 5 px apart.
    let (x0, plot_w) = (96i32, 760i32);
    let gap = 5i32;
    let cell_h = ((420 - gap * (nl as i32 - 1)).max(nl as i32 * heads as i32)
        / (nl * heads) as i32)
        .clamp(1, 24);
    let block_h = cell_h * heads as i32;
    let heat_y = 86i32;
    let heat_h = block_h * nl as i32 + gap * (nl as i32 - 1);
    let bar_h = heat_h.max(80);
    let line_y = heat_y + (heat_h + 86).max(bar_h + 30 + 52);
    let line_h = 240i32;
    let legend_x = x0 + plot_w + 26;
    let legend_rows = nl.min(40);
    let width = (legend_x + 130) as u32;
    let height = (line_y + line_h + 62).max(line_y + legend_rows as i32 * 14 + 60) as u32;
    let mut c = Canvas::new(width, height);

    let ncols = n.min(plot_w as usize);
    let col_x = |k: usize| x0 + (k as i64 * plot_w as i64 / ncols as i64) as i32;
    let col_steps = |k: usize| (k * n / ncols)..((k + 1) * n / ncols).max(k * n / ncols + 1);
    let record_x = |i: usize| x0 + (((i as f64 + 0.5) / n as f64) * plot_w as f64) as i32;
    let layer_y = |li: usize| heat_y + li as i32 * (block_h + gap);
    let rec = |l: u32, i: usize| grid.get(&l).and_then(|m| m.get(&steps[i]).copied());

    c.title(x0, 12, title);
    let many = if ncols < n {
        "  |  each column averages several steps"
    } else {
        ""
    };
    let subtitle = format!(
        "{nl} layer{} x {heads} head{}  |  {n} logged step{} ({} .. {}){many}",
        if nl == 1 { "" } else { "s" },
        if heads == 1 { "" } else { "s" },
        if n == 1 { "" } else { "s" },
        steps[0],
        steps[n - 1],
    );
    c.text(x0, 38, &subtitle, small, AXIS, Align::Left);

    let stride = step_stride(n, plot_w, fw, steps[0], steps[n - 1]);
    let draw_x_axis = |c: &mut Canvas, y_bottom: i32| {
        for i in (0..n).step_by(stride) {
            let x = record_x(i);
            c.line((x, y_bottom + 1), (x, y_bottom + 5), AXIS, 1);
            c.text(
                x,
                y_bottom + 8,
                &steps[i].to_string(),
                small,
                INK,
                Align::Centre,
            );
        }
        let y = y_bottom + 8 + fh + 6;
        c.text(x0 + plot_w / 2 - 2 * fw, y, "step", bold, INK, Align::Left);
    };

    // Panel 1: sink mass, one block of head rows per layer, one colour scale.
    c.text(
        x0,
        heat_y - 26,
        "sink mass (mean over valid rows) per layer and head",
        bold,
        INK,
        Align::Left,
    );
    let sink = |r: &TelemetryRecord, h: usize| -> Option<f64> {
        r.sink_mass
            .as_ref()
            .and_then(|v| v.get(h).copied().flatten())
    };
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in records
        .iter()
        .flat_map(|r| (0..heads).filter_map(move |h| sink(r, h)))
        .filter(|v| v.is_finite())
    {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    let have_sink = lo <= hi;
    let (lo_s, hi_s) = if !have_sink {
        (0.0, 1.0)
    } else if hi - lo < 1e-12 {
        ((lo - 0.05).max(0.0), (hi + 0.05).min(1.0).max(lo + 1e-6))
    } else {
        (lo, hi)
    };
    for (li, &l) in layers.iter().enumerate() {
        let y0 = layer_y(li);
        for k in 0..ncols {
            let (xa, xb) = (col_x(k), col_x(k + 1));
            for h in 0..heads {
                let v = mean_defined(col_steps(k).map(|i| rec(l, i).and_then(|r| sink(r, h))));
                let colour = v.map_or(NO_DATA, |v| colour_map((v - lo_s) / (hi_s - lo_s)));
                c.rect(xa, y0 + h as i32 * cell_h, (xb - xa).max(1), cell_h, colour);
            }
        }
        c.frame(x0, y0, plot_w, block_h, AXIS);
        // Layer label; head labels when the rows are tall enough to read.
        if block_h >= fh {
            let label = format!("L{l}");
            c.text(
                x0 - 34,
                y0 + block_h / 2 - fh / 2,
                &label,
                bold,
                INK,
                Align::Right,
            );
        }
        if cell_h >= fh {
            for h in 0..heads {
                let y = y0 + h as i32 * cell_h + cell_h / 2;
                c.text(
                    x0 - 6,
                    y - fh / 2,
                    &format!("h{h}"),
                    small,
                    INK,
                    Align::Right,
                );
            }
        }
    }
    if !have_sink {
        c.text(
            x0 + plot_w / 2,
            heat_y + heat_h / 2 - fh / 2,
            "no sink-mass data (sink stream off?)",
            small,
            INK,
            Align::Centre,
        );
    }
    draw_x_axis(&mut c, heat_y + heat_h);
    let bar_w = 18;
    for yy in 0..bar_h {
        let t = 1.0 - yy as f64 / (bar_h - 1).max(1) as f64;
        c.rect(legend_x, heat_y + yy, bar_w, 1, colour_map(t));
    }
    c.frame(legend_x, heat_y, bar_w, bar_h, AXIS);
    let lx = legend_x + bar_w + 6;
    c.text(
        lx,
        heat_y - 2,
        &format!("max {}", number_label(hi_s)),
        small,
        INK,
        Align::Left,
    );
    let min_label = format!("min {}", number_label(lo_s));
    c.text(
        lx,
        heat_y + bar_h - fh + 2,
        &min_label,
        small,
        INK,
        Align::Left,
    );
    c.rect(legend_x, heat_y + bar_h + 10, 12, 12, NO_DATA);
    c.text(
        legend_x + 16,
        heat_y + bar_h + 10,
        "no data",
        small,
        AXIS,
        Align::Left,
    );

    // Panel 2: per layer, the largest max_logit over its heads.
    c.text(
        x0,
        line_y - 26,
        "max_logit (pre-softcap), largest over the heads of each layer",
        bold,
        INK,
        Align::Left,
    );
    let series: Vec<Vec<Option<f64>>> = layers
        .iter()
        .map(|&l| {
            (0..ncols)
                .map(|k| {
                    mean_defined(col_steps(k).map(|i| {
                        rec(l, i).and_then(|r| {
                            r.max_logit
                                .iter()
                                .flatten()
                                .copied()
                                .filter(|v| v.is_finite())
                                .reduce(f64::max)
                        })
                    }))
                })
                .collect()
        })
        .collect();
    let cx = |k: usize| (col_x(k) + col_x(k + 1)) / 2;
    let panel = Panel {
        x0,
        y: line_y,
        w: plot_w,
        h: line_h,
    };
    line_panel(&mut c, panel, &series, cx, 2, false, "no max_logit data");
    draw_x_axis(&mut c, line_y + line_h);
    c.text(legend_x, line_y - 14, "layers", bold, INK, Align::Left);
    for (li, &l) in layers.iter().take(legend_rows).enumerate() {
        let ly = line_y + li as i32 * (fh + 1);
        c.rect(legend_x, ly + 3, 14, 7, head_colour(li));
        c.text(legend_x + 18, ly, &format!("L{l}"), small, INK, Align::Left);
    }
    c.png()
}
