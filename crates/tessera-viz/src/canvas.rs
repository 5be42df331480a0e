//! A raster canvas with bitmap-font text, lines and rectangles, shared by every picture, and
//! the number formatting and colour maps of the charts.

use embedded_graphics::mono_font::{ascii::FONT_10X20, MonoFont, MonoTextStyle};
use embedded_graphics::pixelcolor::Rgb888;
use embedded_graphics::prelude::*;
use embedded_graphics::primitives::{Line, PrimitiveStyle};
use embedded_graphics::text::{Baseline, Text};
use image::{Rgb, RgbImage};
use tessera_core::{Error, Result};

/// Text colour.
pub(crate) const INK: [u8; 3] = [20, 20, 20];
/// Axes, frames and secondary text.
pub(crate) const AXIS: [u8; 3] = [90, 90, 90];

/// An RGB raster with a white background.
pub(crate) struct Canvas {
    img: RgbImage,
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
            if let (Ok(x), Ok(y)) = (u32::try_from(p.x), u32::try_from(p.y)) {
                if x < self.img.width() && y < self.img.height() {
                    self.img.put_pixel(x, y, Rgb([c.r(), c.g(), c.b()]));
                }
            }
        }
        Ok(())
    }
}

/// Where a text's anchor `x` is.
#[derive(Clone, Copy)]
pub(crate) enum Align {
    Left,
    Centre,
    Right,
}

fn rgb(c: [u8; 3]) -> Rgb888 {
    Rgb888::new(c[0], c[1], c[2])
}

impl Canvas {
    pub(crate) fn new(w: u32, h: u32) -> Self {
        Canvas {
            img: RgbImage::from_pixel(w, h, Rgb([255, 255, 255])),
        }
    }

    /// A title in the large 10x20 font, top-left corner at (x, y).
    pub(crate) fn title(&mut self, x: i32, y: i32, s: &str) {
        self.text(x, y, s, &FONT_10X20, INK, Align::Left);
    }

    /// Text in `font` and `colour`, top edge at `y`, anchored at `x` as `align` says.
    pub(crate) fn text(
        &mut self,
        x: i32,
        y: i32,
        s: &str,
        font: &MonoFont<'_>,
        colour: [u8; 3],
        align: Align,
    ) {
        let w = (s.chars().count() as u32 * font.character_size.width) as i32;
        let x = match align {
            Align::Left => x,
            Align::Centre => x - w / 2,
            Align::Right => x - w,
        };
        let style = MonoTextStyle::new(font, rgb(colour));
        let _ = Text::with_baseline(s, Point::new(x, y), style, Baseline::Top).draw(self);
    }

    /// Fills `[x, x + w) × [y, y + h)` (clipped; negative corners are clipped too).
    pub(crate) fn rect(&mut self, x: i32, y: i32, w: i32, h: i32, c: [u8; 3]) {
        let (x0, y0) = (x.max(0) as u32, y.max(0) as u32);
        let x1 = ((x + w).max(0) as u32).min(self.img.width());
        let y1 = ((y + h).max(0) as u32).min(self.img.height());
        for yy in y0..y1 {
            for xx in x0..x1 {
                self.img.put_pixel(xx, yy, Rgb(c));
            }
        }
    }

    /// A straight line `width` pixels wide.
    pub(crate) fn line(&mut self, a: (i32, i32), b: (i32, i32), colour: [u8; 3], width: u32) {
        let style = PrimitiveStyle::with_stroke(rgb(colour), width);
        let _ = Line::new(Point::new(a.0, a.1), Point::new(b.0, b.1))
            .into_styled(style)
            .draw(self);
    }

    /// A one-pixel outline around the area `[x, x + w) × [y, y + h)`.
    pub(crate) fn frame(&mut self, x: i32, y: i32, w: i32, h: i32, colour: [u8; 3]) {
        let (l, t, r, b) = (x - 1, y - 1, x + w, y + h);
        for (p, q) in [
            ((l, t), (r, t)),
            ((l, b), (r, b)),
            ((l, t), (l, b)),
            ((r, t), (r, b)),
        ] {
            self.line(p, q, colour, 1);
        }
    }

    /// The picture as PNG bytes.
    pub(crate) fn png(&self) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        self.img
            .write_to(&mut std::io::Cursor::new(&mut buf), image::ImageFormat::Png)
            .map_err(|e| Error::Internal(format!("PNG encoding: {e}")))?;
        Ok(buf)
    }
}

/// Viridis-like colour map, `t` in `[0, 1]` (dark purple → blue → green → yellow).
pub(crate) fn colour_map(t: f64) -> [u8; 3] {
    #[rustfmt::skip]
    const STOPS: [[f64; 3]; 6] = [
        [68.0, 1.0, 84.0], [65.0, 68.0, 135.0], [42.0, 120.0, 142.0],
        [34.0, 168.0, 132.0], [122.0, 209.0, 81.0], [253.0, 231.0, 37.0],
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

/// A short, readable label for a number.
pub(crate) fn number_label(v: f64) -> String {
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
pub(crate) fn tick_label(v: f64, step: f64) -> String {
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
pub(crate) fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_and_labels() {
        assert_eq!(
            nice_ticks(0.0, 10.0, 5),
            vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        );
        assert!(nice_ticks(1.0, 1.0, 5).is_empty());
        assert!(nice_ticks(f64::NAN, 1.0, 5).is_empty());
        assert_eq!(tick_label(-1e-12, 0.5), "0.0");
        assert_eq!(tick_label(2.5, 0.5), "2.5");
        assert_eq!(number_label(f64::NAN), "n/a");
        assert_eq!(number_label(123.4), "123");
        assert_eq!(colour_map(0.0), [68, 1, 84]);
        assert_eq!(colour_map(f64::INFINITY), [68, 1, 84]);
        assert_eq!(colour_map(1.0), [253, 231, 37]);
    }

    #[test]
    fn drawing_is_clipped() {
        let mut c = Canvas::new(4, 4);
        c.rect(-10, -10, 100, 100, [1, 2, 3]);
        c.line((-5, -5), (50, 50), INK, 3);
        c.frame(0, 0, 4, 4, AXIS);
        assert!(c.png().unwrap().starts_with(b"\x89PNG"));
    }
}
