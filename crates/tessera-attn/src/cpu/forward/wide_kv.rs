//! bf16 K and V widened to f32 once per call for the f32 forward item (the `widen-*` bf16
//! paths): [`WideKv`] holds every kv block (batch, kv head, kv tile) as f32 rows, each block
//! converted by the first item that visits it and read by every later one, where without it
//! every (q tile, kv tile) pair converted its K and V rows again (a causal 8K forward visits
//! each kv tile ~32 times).
//!
//! Contract: a block's K rows are `[tk × Dqkp]`, its V rows `[tk × Dvp]` (`tk` the padded tile
//! side), the values of [`rows`](crate::cpu::load_tile::rows) (exact conversion; padding rows
//! and columns zero), so the item computes the same bits with or without it. Used only when the
//! whole pack fits [`MAX_BYTES`] ([`floats`] is 0 otherwise); its buffers are the workspace's.

use super::super::load_tile::Src;
use super::super::pack_buf::PackBuf;
use super::super::schedule::Geometry;
use crate::validate::Dims;
use std::sync::OnceLock;
use tessera_core::DType;
use tessera_plan::Plan;

/// Largest pack (K and V, bytes) a call widens once; larger calls convert per visit.
pub(crate) const MAX_BYTES: usize = 512 << 20;

/// f32 elements of K and V packs for a forward of `d` over `plan` (0: none is used).
pub(crate) fn floats(plan: &Plan, d: &Dims) -> (usize, usize) {
    if d.dtype != DType::BF16 {
        return (0, 0);
    }
    let g = Geometry::new(plan, d);
    let blocks = d.batch * d.heads_kv * plan.kv_tiles;
    let (k, v) = (blocks * g.tk * g.dqkp, blocks * g.tk * g.dvp);
    if 4 * (k + v) > MAX_BYTES {
        return (0, 0);
    }
    (k, v)
}

/// The widened blocks of one call (see the module contract).
pub(crate) struct WideKv<'a> {
    plan: &'a Plan,
    d: Dims,
    g: Geometry,
    k_src: Src<'a>,
    v_src: Src<'a>,
    k: PackBuf<'a, f32>,
    v: PackBuf<'a, f32>,
    done: Vec<OnceLock<()>>,
}

impl<'a> WideKv<'a> {
    /// The packs over the workspace's buffers, when [`floats`] allows one for this call.
    pub(crate) fn new(
        plan: &'a Plan,
        d: &Dims,
        (k_src, v_src): (Src<'a>, Src<'a>),
        (kbuf, vbuf): (&'a mut Vec<f32>, &'a mut Vec<f32>),
    ) -> Option<Self> {
        let (kn, vn) = floats(plan, d);
        if kn == 0 {
            return None;
        }
        let grow = |b: &'a mut Vec<f32>, n: usize| -> &'a mut [f32] {
            if b.len() < n {
                b.resize(n, 0.0);
            }
            &mut b[..n]
        };
        let blocks = d.batch * d.heads_kv * plan.kv_tiles;
        Some(WideKv {
            plan,
            d: *d,
            g: Geometry::new(plan, d),
            k_src,
            v_src,
            k: PackBuf::new(grow(kbuf, kn)),
            v: PackBuf::new(grow(vbuf, vn)),
            done: (0..blocks).map(|_| OnceLock::new()).collect(),
        })
    }

    /// Block `blk`'s K rows and their leading dimension (converted now if no item did).
    pub(crate) fn k(&self, blk: usize) -> (&[f32], usize) {
        self.block(blk);
        let n = self.g.tk * self.g.dqkp;
        // SAFETY: `block` returned, so block `blk` is written.
        (unsafe { self.k.read(blk * n..(blk + 1) * n) }, self.g.dqkp)
    }

    /// Block `blk`'s V rows and their leading dimension (converted now if no item did).
    pub(crate) fn v(&self, blk: usize) -> (&[f32], usize) {
        self.block(blk);
        let n = self.g.tk * self.g.dvp;
        // SAFETY: as in `k`.
        (unsafe { self.v.read(blk * n..(blk + 1) * n) }, self.g.dvp)
    }

    fn block(&self, blk: usize) {
        self.done[blk].get_or_init(|| {
            let (d, g, nkt) = (&self.d, &self.g, self.plan.kv_tiles);
            let (bg, kt) = (blk / nkt, blk % nkt);
            let (b, h) = (bg / d.heads_kv, bg % d.heads_kv);
            let (k0, k1) = self.plan.kv_range(kt);
            for (src, pack, dim, ld) in [
                (self.k_src, &self.k, d.d_qk, g.dqkp),
                (self.v_src, &self.v, d.d_v, g.dvp),
            ] {
                let n = g.tk * ld;
                // SAFETY: inside block `blk`'s initialisation; the range is that block's.
                let dst = unsafe { pack.write(blk * n..(blk + 1) * n) };
                let off = src.row(b, h, k0);
                for (j, row) in dst.chunks_exact_mut(ld).enumerate() {
                    if j < k1 - k0 {
                        src.load(off + j * src.ld(), &mut row[..dim], 1.0);
                        row[dim..].fill(0.0);
                    } else {
                        row.fill(0.0);
                    }
                }
            }
        });
    }
}
