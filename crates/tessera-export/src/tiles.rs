//! The plan's tiles as both engines see them: sequences padded up to whole blocks.
//!
//! Splash and FlexAttention both work on masks whose lengths are multiples of the block sizes
//! (FlexAttention pads the dense mask with `False` internally; Splash requires it). With padding
//! tokens that attend nothing and are attended by nothing, a tile on a ragged edge that Tessera
//! marks Full (every in-range pair allowed) contains padded pairs and therefore is *partial* for
//! the engines. Its partial block is the in-range rectangle of ones. Empty and Partial tiles are
//! unchanged (Tessera's partial bitmasks already hold 0 for out-of-range pairs).

use tessera_plan::{Plan, TileEntry, TileState};

/// How an engine sees one non-empty tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Eff {
    Full,
    /// Partial, with a content id (see [`Contents`]).
    Partial(u32),
}

/// Partial-block contents: the plan's deduplicated bitmasks (ids `0..n`) plus the in-range
/// rectangles of ragged Full tiles that are not already in the plan's table (ids `n..`).
/// Distinct ids always have distinct contents.
pub(crate) struct Contents<'a> {
    pub plan: &'a Plan,
    /// Content ids of the plan's own blocks: its table's, or one shared by every partial tile
    /// of a plan without masks (contents unknown: [`Contents::bits`] must not be asked).
    own: u32,
    extra: Vec<Vec<u64>>,
    /// Content id of the rectangle for (ragged row?, ragged column?).
    rect: [[u32; 2]; 2],
    ragged_q: bool,
    ragged_kv: bool,
}

impl<'a> Contents<'a> {
    pub fn new(plan: &'a Plan) -> Self {
        let (tq, tk) = (plan.tile.q, plan.tile.kv);
        let ragged_q = plan.shape.q_len % tq != 0;
        let ragged_kv = plan.shape.kv_len % tk != 0;
        let own = if plan.has_masks() {
            plan.partials.len() as u32
        } else {
            1
        };
        let mut c = Contents {
            plan,
            own,
            extra: Vec::new(),
            rect: [[u32::MAX; 2]; 2],
            ragged_q,
            ragged_kv,
        };
        if !ragged_q && !ragged_kv {
            return c;
        }
        let p = &plan.partials;
        // At most three rectangles are looked up: a scan comparing masks (which mostly differ in
        // their first words) costs far less than hashing every mask of the table.
        let find = |bits: &[u64]| (0..p.len() as u32).find(|&id| p.get(id) == bits);
        let n = own;
        let mut rects = [[u32::MAX; 2]; 2];
        let mut extra: Vec<Vec<u64>> = Vec::new();
        for (rq, row) in rects.iter_mut().enumerate() {
            for (rk, slot) in row.iter_mut().enumerate() {
                if (rq == 1 && !ragged_q) || (rk == 1 && !ragged_kv) || (rq == 0 && rk == 0) {
                    continue;
                }
                let rows = if rq == 1 { plan.shape.q_len % tq } else { tq };
                let cols = if rk == 1 { plan.shape.kv_len % tk } else { tk };
                let bits = rectangle(tq, p.words_per_row, rows, cols);
                *slot = match find(&bits) {
                    Some(id) => id,
                    None => match extra.iter().position(|e| *e == bits) {
                        Some(k) => n + k as u32,
                        None => {
                            extra.push(bits);
                            n + extra.len() as u32 - 1
                        }
                    },
                };
            }
        }
        c.extra = extra;
        c.rect = rects;
        c
    }

    /// Number of content ids.
    pub fn len(&self) -> usize {
        self.own as usize + self.extra.len()
    }

    /// Bitmask words of content `id` (`tile.q` rows of `words_per_row` words).
    pub fn bits(&self, id: u32) -> &[u64] {
        let n = self.own;
        if id < n {
            self.plan.partials.get(id)
        } else {
            &self.extra[(id - n) as usize]
        }
    }

    /// Whether tile (`qt`, `kt`) touches a ragged edge.
    fn edge(&self, qt: usize, kt: usize) -> (bool, bool) {
        (
            self.ragged_q && qt + 1 == self.plan.q_tiles,
            self.ragged_kv && kt + 1 == self.plan.kv_tiles,
        )
    }

    /// The engine view of a non-empty tile (`qt`, `kt`) with plan entry `e`.
    #[inline]
    pub fn effective(&self, qt: usize, kt: usize, e: &TileEntry) -> Eff {
        if !e.is_full() {
            return Eff::Partial(e.mask);
        }
        match self.edge(qt, kt) {
            (false, false) => Eff::Full,
            (a, b) => Eff::Partial(self.rect[a as usize][b as usize]),
        }
    }
}

fn rectangle(tq: usize, wpr: usize, rows: usize, cols: usize) -> Vec<u64> {
    let mut bits = vec![0u64; tq * wpr];
    for r in 0..rows {
        for c in 0..cols {
            bits[r * wpr + c / 64] |= 1u64 << (c % 64);
        }
    }
    bits
}

/// Tile states `[B', H', nq, nk]` as Splash and FlexAttention see them: [`Plan::states`] except
/// that Full tiles on a ragged edge (last q tile when `Lq % tile.q != 0`, last kv tile when
/// `Lkv % tile.kv != 0`) are Partial, because the engines pad the sequences with masked-out
/// tokens up to whole blocks.
pub fn engine_states(plan: &Plan) -> ([usize; 4], Vec<i8>) {
    let (shape, mut states) = plan.states();
    let (nq, nk) = (plan.q_tiles, plan.kv_tiles);
    let ragged_q = plan.shape.q_len % plan.tile.q != 0;
    let ragged_kv = plan.shape.kv_len % plan.tile.kv != 0;
    let full = TileState::Full as i8;
    let partial = TileState::Partial as i8;
    for g in 0..shape[0] * shape[1] {
        let grid = &mut states[g * nq * nk..(g + 1) * nq * nk];
        if ragged_q {
            for s in &mut grid[(nq - 1) * nk..] {
                if *s == full {
                    *s = partial;
                }
            }
        }
        if ragged_kv {
            for qt in 0..nq {
                let s = &mut grid[qt * nk + nk - 1];
                if *s == full {
                    *s = partial;
                }
            }
        }
    }
    (shape, states)
}
