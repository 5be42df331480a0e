//! PNG pictures for people: the tile-state map of a plan, and shared drawing helpers
//! (a raster canvas with bitmap-font text) that other pictures reuse.
//!
//! Contract: pictures are written atomically; text uses a built-in bitmap font, so no font files
//! or system libraries are needed.

use embedded_graphics::mono_font::{ascii::FONT_10X20, ascii::FONT_6X10, MonoTextStyle};
use embedded_graphics::pixelcolor::Rgb888;
use embedded_graphics::prelude::*;
use embedded_graphics::text::{Baseline, Text};
use image::{Rgb, RgbImage};
use std::path::Path;
use tessera_core::{Error, Result};
use tessera_plan::Plan;

/// An RGB raster with text drawing.
pub struct Canvas {
    pub img: RgbImage,
}

impl OriginDimensions for Canvas {
    fn size(&self) -> Size {
        Size::new(self.img.width(), self.img.height())
    }
}

impl DrawTarget for Canvas {
    type Color = Rgb888;
    type Error = std::convert::Infallible;
    fn draw_iter<I: IntoIterator<Item = Pixel<Rgb888>>>(
        &mut self,
        pixels: I,
    ) -> std::result::Result<(), Self::Error> {
        for Pixel(p, c) in pixels {
            if p.x >= 0
                && p.y >= 0
                && (p.x as u32) < self.img.width()
                && (p.y as u32) < self.img.height()
            {
                self.img
                    .put_pixel(p.x as u32, p.y as u32, Rgb([c.r(), c.g(), c.b()]));
            }
        }
        Ok(())
    }
}

impl Canvas {
    pub fn new(w: u32, h: u32) -> Self {
        Canvas {
            img: RgbImage::from_pixel(w, h, Rgb([255, 255, 255])),
        }
    }

    /// Draws text with its top-left corner at (x, y); `large` picks a 10x20 font over 6x10.
    pub fn text(&mut self, x: i32, y: i32, s: &str, large: bool) {
        let font = if large { &FONT_10X20 } else { &FONT_6X10 };
        let style = MonoTextStyle::new(font, Rgb888::new(20, 20, 20));
        let _ = Text::with_baseline(s, Point::new(x, y), style, Baseline::Top).draw(self);
    }

    pub fn rect(&mut self, x: u32, y: u32, w: u32, h: u32, c: [u8; 3]) {
        for yy in y..(y + h).min(self.img.height()) {
            for xx in x..(x + w).min(self.img.width()) {
                self.img.put_pixel(xx, yy, Rgb(c));
            }
        }
    }

    /// Writes the canvas as PNG, atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut buf = Vec::new();
        image::DynamicImage::ImageRgb8(self.img.clone())
            .write_to(&mut std::io::Cursor::new(&mut buf), image::ImageFormat::Png)
            .map_err(|e| Error::Internal(format!("PNG encoding: {e}")))?;
        tessera_io::atomic_write(path, |w| w.write_all(&buf).map_err(|e| Error::io(path, e)))
    }
}

pub const EMPTY: [u8; 3] = [242, 242, 242];
pub const PARTIAL: [u8; 3] = [242, 142, 43];
pub const FULL: [u8; 3] = [47, 93, 140];

/// Draws the tile states of batch row `b`, head `h` of `plan`, downsampled so the map fits in
/// about 900 pixels (each pixel then blends the states it covers), with a legend and caption.
pub fn plan_picture(plan: &Plan, b: usize, h: usize, title: &str, path: &Path) -> Result<()> {
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
    let (mw, mh) = ((pw * ppt) as u32, (ph * ppt) as u32);
    let margin = 20u32;
    let width = (mw + 2 * margin).max(620);
    let height = mh + 2 * margin + 110;
    let mut c = Canvas::new(width, height);
    // Count partial and full tiles per pixel block from the sparse work list.
    let mut counts = vec![[0u32; 2]; pw * ph];
    let hp = plan.head_plan(b, h);
    for qt in 0..nq {
        for e in hp.row(qt) {
            let cell = &mut counts[(qt / tpp) * pw + e.tile as usize / tpp];
            cell[if e.is_full() { 1 } else { 0 }] += 1;
        }
    }
    for py in 0..ph {
        for px in 0..pw {
            let tiles = ((nq - py * tpp).min(tpp) * (nk - px * tpp).min(tpp)) as f32;
            let [p, f] = counts[py * pw + px];
            let e = tiles - p as f32 - f as f32;
            let mix = |k: usize| {
                ((EMPTY[k] as f32 * e + PARTIAL[k] as f32 * p as f32 + FULL[k] as f32 * f as f32)
                    / tiles)
                    .round() as u8
            };
            let colour = [mix(0), mix(1), mix(2)];
            c.rect(
                margin + (px * ppt) as u32,
                margin + (py * ppt) as u32,
                ppt as u32,
                ppt as u32,
                colour,
            );
        }
    }
    // Frame around the map.
    for x in margin - 1..=margin + mw {
        c.img.put_pixel(x, margin - 1, Rgb([90, 90, 90]));
        c.img.put_pixel(x, margin + mh, Rgb([90, 90, 90]));
    }
    for y in margin - 1..=margin + mh {
        c.img.put_pixel(margin - 1, y, Rgb([90, 90, 90]));
        c.img.put_pixel(margin + mw, y, Rgb([90, 90, 90]));
    }
    let y0 = (margin + mh + 12) as i32;
    let s = &plan.stats;
    c.text(margin as i32, y0, title, true);
    c.text(
        margin as i32,
        y0 + 26,
        &format!(
            "B={} H={} Lq={} Lkv={}  tile {}  grid {}x{}  (batch {b}, head {h}; rows = queries, cols = keys)",
            plan.shape.batch, plan.shape.heads, plan.shape.q_len, plan.shape.kv_len, plan.tile, nq, nk
        ),
        false,
    );
    c.text(
        margin as i32,
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
        false,
    );
    let ly = y0 + 60;
    for (k, (name, col)) in [("empty", EMPTY), ("partial", PARTIAL), ("full", FULL)]
        .iter()
        .enumerate()
    {
        let x = margin + 110 * k as u32;
        c.rect(x, ly as u32, 16, 16, *col);
        c.rect(x, ly as u32, 16, 1, [90, 90, 90]);
        c.text(x as i32 + 22, ly + 2, name, false);
    }
    c.save(path)
}

// ---------------------------------------------------------------------------------------------
// Telemetry picture: sink mass as a head × step heatmap and max_logit per head over steps.
// ---------------------------------------------------------------------------------------------

use embedded_graphics::mono_font::ascii::{FONT_7X13, FONT_7X13_BOLD};
use embedded_graphics::mono_font::MonoFont;
use embedded_graphics::primitives::{Line, PrimitiveStyle};
use tessera_telemetry::TelemetryRecord;

const INK: [u8; 3] = [20, 20, 20];
const AXIS: [u8; 3] = [90, 90, 90];
const GRID: [u8; 3] = [228, 228, 228];
const NO_DATA: [u8; 3] = [205, 205, 205];

/// Distinct line colours (Tableau 20 order: the 10 strong colours first).
const HEAD_COLOURS: [[u8; 3]; 20] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
    [174, 199, 232],
    [255, 187, 120],
    [152, 223, 138],
    [255, 152, 150],
    [197, 176, 213],
    [196, 156, 148],
    [247, 182, 210],
    [199, 199, 199],
    [219, 219, 141],
    [158, 218, 229],
];

/// Most heads a telemetry picture draws (one heatmap row each).
pub const MAX_PLOT_HEADS: usize = 1024;

/// Colour of head `h` in line charts.
pub fn head_colour(h: usize) -> [u8; 3] {
    HEAD_COLOURS[h % HEAD_COLOURS.len()]
}

/// Viridis-like colour map, `t` in `[0, 1]` (dark purple → blue → green → yellow).
pub fn colour_map(t: f64) -> [u8; 3] {
    const STOPS: [[f64; 3]; 6] = [
        [68.0, 1.0, 84.0],
        [65.0, 68.0, 135.0],
        [42.0, 120.0, 142.0],
        [34.0, 168.0, 132.0],
        [122.0, 209.0, 81.0],
        [253.0, 231.0, 37.0],
    ];
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let x = t * (STOPS.len() - 1) as f64;
    let i = (x.floor() as usize).min(STOPS.len() - 2);
    let f = x - i as f64;
    let c = |k: usize| (STOPS[i][k] + (STOPS[i + 1][k] - STOPS[i][k]) * f).round() as u8;
    [c(0), c(1), c(2)]
}

impl Canvas {
    /// Draws text in `font` and `colour` with its top-left corner at (x, y).
    pub fn text_font(&mut self, x: i32, y: i32, s: &str, font: &MonoFont<'_>, colour: [u8; 3]) {
        let style = MonoTextStyle::new(font, Rgb888::new(colour[0], colour[1], colour[2]));
        let _ = Text::with_baseline(s, Point::new(x, y), style, Baseline::Top).draw(self);
    }

    /// Draws text in `font` whose right edge is at `x`.
    pub fn text_right(&mut self, x: i32, y: i32, s: &str, font: &MonoFont<'_>) {
        let w = (s.chars().count() as u32 * font.character_size.width) as i32;
        self.text_font(x - w, y, s, font, INK);
    }

    /// Draws text in `font` centred on `x`.
    pub fn text_centred(&mut self, x: i32, y: i32, s: &str, font: &MonoFont<'_>) {
        let w = (s.chars().count() as u32 * font.character_size.width) as i32;
        self.text_font(x - w / 2, y, s, font, INK);
    }

    /// A straight line `width` pixels wide.
    pub fn line(&mut self, a: (i32, i32), b: (i32, i32), colour: [u8; 3], width: u32) {
        let style =
            PrimitiveStyle::with_stroke(Rgb888::new(colour[0], colour[1], colour[2]), width);
        let _ = Line::new(Point::new(a.0, a.1), Point::new(b.0, b.1))
            .into_styled(style)
            .draw(self);
    }

    /// A one-pixel rectangle outline around the area `[x, x + w) × [y, y + h)`.
    pub fn frame(&mut self, x: i32, y: i32, w: i32, h: i32, colour: [u8; 3]) {
        self.line((x - 1, y - 1), (x + w, y - 1), colour, 1);
        self.line((x - 1, y + h), (x + w, y + h), colour, 1);
        self.line((x - 1, y - 1), (x - 1, y + h), colour, 1);
        self.line((x + w, y - 1), (x + w, y + h), colour, 1);
    }
}

/// A short, readable label for a number.
pub fn number_label(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".to_string();
    }
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.2e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// A tick label with as many decimals as the tick spacing `step` needs.
pub fn tick_label(v: f64, step: f64) -> String {
    let a = v.abs().max(step.abs());
    if a != 0.0 && !(1e-3..1e6).contains(&a) {
        return format!("{v:.1e}");
    }
    let decimals = if step > 0.0 && step.is_finite() {
        (-step.log10().floor()).clamp(0.0, 6.0) as usize
    } else {
        2
    };
    // Avoid "-0".
    let v = if v.abs() < step.abs() * 1e-9 { 0.0 } else { v };
    format!("{v:.decimals$}")
}

/// About `n` round tick values (1, 2, 5 × 10^k apart) inside `[lo, hi]`.
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite()) || hi <= lo || n == 0 {
        return Vec::new();
    }
    let raw = (hi - lo) / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    if !(step.is_finite() && step > 0.0) {
        return Vec::new();
    }
    let (first, last) = ((lo / step).ceil(), (hi / step).floor());
    if !(first.is_finite() && last.is_finite()) || last - first > 4.0 * n as f64 + 4.0 {
        return Vec::new();
    }
    let (first, last) = (first as i64, last as i64);
    (first..=last).map(|k| k as f64 * step).collect()
}

/// Mean of the finite values, `None` if there are none.
fn mean_defined(vals: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let (mut s, mut n) = (0.0, 0usize);
    for v in vals.flatten().filter(|v| v.is_finite()) {
        s += v;
        n += 1;
    }
    (n > 0).then(|| s / n as f64)
}

/// Draws the telemetry of one layer: records sorted by step, all with the same head count.
///
/// Top panel: sink mass as a head × step heatmap (colour bar with min/max labels; grey = no
/// data); bottom panel: max_logit per head over steps (one colour per head, legend on the
/// right). More steps than pixel columns are averaged per column.
pub fn telemetry_picture(records: &[TelemetryRecord], title: &str, path: &Path) -> Result<()> {
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
    let n = records.len();
    let (fw, fh) = (7i32, 13i32);
    let small = &FONT_7X13;

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
    c.text(x0, 12, title, true);
    let (s0, s1) = (first.step, records[n - 1].step);
    c.text_font(
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
    );

    // X ticks (shared by both panels).
    let label_w = fw * (s1.to_string().len().max(s0.to_string().len()) as i32) + 14;
    let max_ticks = (plot_w / label_w).max(1) as usize;
    let mut stride;
    let mut pow = 1usize;
    'search: loop {
        for m in [1usize, 2, 5] {
            stride = m * pow;
            if n.div_ceil(stride) <= max_ticks {
                break 'search;
            }
        }
        pow *= 10;
    }
    let ticks: Vec<usize> = (0..n).step_by(stride).collect();
    let draw_x_axis = |c: &mut Canvas, y_bottom: i32| {
        for &i in &ticks {
            let x = record_x(i);
            c.line((x, y_bottom + 1), (x, y_bottom + 5), AXIS, 1);
            c.text_centred(x, y_bottom + 8, &records[i].step.to_string(), small);
        }
        c.text_font(
            x0 + plot_w / 2 - 2 * fw,
            y_bottom + 8 + fh + 6,
            "step",
            &FONT_7X13_BOLD,
            INK,
        );
    };

    // Panel 1: sink-mass heatmap.
    c.text_font(
        x0,
        heat_y - 26,
        "sink mass (mean over valid rows)",
        &FONT_7X13_BOLD,
        INK,
    );
    let sink = |r: &TelemetryRecord, h: usize| -> Option<f64> {
        r.sink_mass
            .as_ref()
            .and_then(|v| v.get(h).copied().flatten())
    };
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for r in records {
        for h in 0..heads {
            if let Some(v) = sink(r, h).filter(|v| v.is_finite()) {
                lo = lo.min(v);
                hi = hi.max(v);
            }
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
            c.rect(
                xa as u32,
                (heat_y + h as i32 * cell_h) as u32,
                (xb - xa).max(1) as u32,
                cell_h as u32,
                colour,
            );
        }
    }
    c.frame(x0, heat_y, plot_w, heat_h, AXIS);
    if !have_sink {
        c.text_centred(
            x0 + plot_w / 2,
            heat_y + heat_h / 2 - fh / 2,
            "no sink-mass data (sink stream off?)",
            small,
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
        let y = heat_y + h as i32 * cell_h + cell_h / 2;
        c.line((x0 - 6, y), (x0 - 2, y), AXIS, 1);
        c.text_right(x0 - 9, y - fh / 2, &h.to_string(), small);
    }
    c.text_font(
        x0 - 9 - 4 * fw,
        heat_y - 26 + 12,
        "head",
        &FONT_7X13_BOLD,
        INK,
    );
    draw_x_axis(&mut c, heat_y + heat_h);
    // Colour bar.
    let bar_w = 18;
    for yy in 0..bar_h {
        let t = 1.0 - yy as f64 / (bar_h - 1).max(1) as f64;
        c.rect(
            legend_x as u32,
            (heat_y + yy) as u32,
            bar_w as u32,
            1,
            colour_map(t),
        );
    }
    c.frame(legend_x, heat_y, bar_w, bar_h, AXIS);
    c.text_font(
        legend_x + bar_w + 6,
        heat_y - 2,
        &format!("max {}", number_label(hi_s)),
        small,
        INK,
    );
    c.text_font(
        legend_x + bar_w + 6,
        heat_y + bar_h - fh + 2,
        &format!("min {}", number_label(lo_s)),
        small,
        INK,
    );
    c.rect(
        legend_x as u32,
        (heat_y + bar_h + 10) as u32,
        12,
        12,
        NO_DATA,
    );
    c.text_font(legend_x + 16, heat_y + bar_h + 10, "no data", small, AXIS);

    // Panel 2: max_logit lines.
    c.text_font(
        x0,
        line_y - 26,
        "max_logit (pre-softcap) per head",
        &FONT_7X13_BOLD,
        INK,
    );
    let series: Vec<Vec<Option<f64>>> = (0..heads)
        .map(|h| {
            (0..ncols)
                .map(|k| mean_defined(col_records(k).map(|i| records[i].max_logit[h])))
                .collect()
        })
        .collect();
    let (mut ylo, mut yhi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in series.iter().flatten().flatten() {
        ylo = ylo.min(*v);
        yhi = yhi.max(*v);
    }
    let have_logits = ylo <= yhi;
    if !have_logits {
        (ylo, yhi) = (0.0, 1.0);
    } else if yhi - ylo < 1e-9 {
        (ylo, yhi) = (ylo - 0.5, yhi + 0.5);
    } else {
        let pad = 0.06 * (yhi - ylo);
        (ylo, yhi) = (ylo - pad, yhi + pad);
    }
    let y_of = |v: f64| {
        line_y + line_h - 1 - ((v - ylo) / (yhi - ylo) * (line_h - 1) as f64).round() as i32
    };
    let yticks = nice_ticks(ylo, yhi, 6);
    let tick_step = if yticks.len() >= 2 {
        yticks[1] - yticks[0]
    } else {
        1.0
    };
    for &t in &yticks {
        let y = y_of(t);
        c.line((x0, y), (x0 + plot_w - 1, y), GRID, 1);
        c.line((x0 - 6, y), (x0 - 2, y), AXIS, 1);
        c.text_right(x0 - 9, y - fh / 2, &tick_label(t, tick_step), small);
    }
    c.frame(x0, line_y, plot_w, line_h, AXIS);
    if !have_logits {
        c.text_centred(
            x0 + plot_w / 2,
            line_y + line_h / 2 - fh / 2,
            "no max_logit data",
            small,
        );
    }
    let cx = |k: usize| (col_x(k) + col_x(k + 1)) / 2;
    let thick = if heads <= 8 { 2 } else { 1 };
    for (h, s) in series.iter().enumerate() {
        let colour = head_colour(h);
        let mut prev: Option<(i32, i32)> = None;
        for (k, v) in s.iter().enumerate() {
            match v {
                Some(v) => {
                    let p = (cx(k), y_of(*v));
                    if let Some(q) = prev {
                        c.line(q, p, colour, thick);
                    } else if s.get(k + 1).is_none_or(|nv| nv.is_none()) {
                        c.rect(
                            (p.0 - 1).max(0) as u32,
                            (p.1 - 1).max(0) as u32,
                            3,
                            3,
                            colour,
                        );
                    }
                    if ncols <= 40 {
                        c.rect(
                            (p.0 - 2).max(0) as u32,
                            (p.1 - 2).max(0) as u32,
                            5,
                            5,
                            colour,
                        );
                    }
                    prev = Some(p);
                }
                None => prev = None,
            }
        }
    }
    c.text_font(
        x0 - 9 - 9 * fw,
        line_y - 26 + 12,
        "max_logit",
        &FONT_7X13_BOLD,
        INK,
    );
    draw_x_axis(&mut c, line_y + line_h);
    // Head legend.
    c.text_font(legend_x, line_y - 26 + 12, "heads", &FONT_7X13_BOLD, INK);
    for h in 0..legend_entries {
        let lx = legend_x + 56 * (h / per_col) as i32;
        let ly = line_y + (h % per_col) as i32 * (fh + 1);
        c.rect(lx as u32, (ly + 3) as u32, 14, 7, head_colour(h));
        c.text_font(lx + 18, ly, &format!("h{h}"), small, INK);
    }
    if legend_entries < heads {
        let ly = line_y + per_col as i32 * (fh + 1) + 4;
        let n = HEAD_COLOURS.len();
        c.text_font(legend_x, ly, "colours repeat", small, AXIS);
        c.text_font(legend_x, ly + fh, &format!("every {n} heads"), small, AXIS);
    }
    c.save(path)
}
