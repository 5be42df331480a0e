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
