//! Assigning pieces to rows.
//!
//! Contract: given piece lengths (each in `1..=L`), returns for every piece its row, its first
//! column and its segment id within the row. Rows are filled left to right without gaps, segment
//! ids count 0, 1, 2, ... in column order, every row holds at least one piece, and the result
//! depends only on the lengths (deterministic).

use crate::Strategy;
use std::collections::BTreeSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub row: u32,
    pub col: u32,
    pub seg: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct Placement {
    pub rows: usize,
    /// Indexed like the input pieces.
    pub slots: Vec<Slot>,
}

/// Row bookkeeping while placing: columns used and pieces placed so far.
#[derive(Clone, Copy)]
struct Row {
    used: u32,
    pieces: u32,
}

impl Row {
    fn push(&mut self, row: usize, len: u32) -> Slot {
        let slot = Slot {
            row: row as u32,
            col: self.used,
            seg: self.pieces,
        };
        self.used += len;
        self.pieces += 1;
        slot
    }
}

pub(crate) fn place(pieces: &[u32], seq_len: u32, strategy: Strategy) -> Placement {
    match strategy {
        Strategy::Greedy => greedy(pieces, seq_len),
        Strategy::BestFit => {
            let bfd = best_fit_decreasing(pieces, seq_len);
            // BFD is a heuristic: on rare inputs the in-order placement is tighter. Counting
            // greedy rows is O(n), so best-fit can promise never to be worse than greedy.
            if greedy_rows(pieces, seq_len) < bfd.rows {
                greedy(pieces, seq_len)
            } else {
                bfd
            }
        }
    }
}

fn greedy_rows(pieces: &[u32], seq_len: u32) -> usize {
    let mut rows = 0;
    let mut used = seq_len; // forces a new row for the first piece
    for &len in pieces {
        if used + len > seq_len {
            rows += 1;
            used = 0;
        }
        used += len;
    }
    rows
}

fn greedy(pieces: &[u32], seq_len: u32) -> Placement {
    let mut rows: Vec<Row> = Vec::new();
    let mut slots = Vec::with_capacity(pieces.len());
    for &len in pieces {
        match rows.last() {
            Some(r) if r.used + len <= seq_len => {}
            _ => rows.push(Row { used: 0, pieces: 0 }),
        }
        let idx = rows.len() - 1;
        slots.push(rows[idx].push(idx, len));
    }
    Placement {
        rows: rows.len(),
        slots,
    }
}

/// Best-fit decreasing in O(n log n): the open rows live in a B-tree ordered by (remaining
/// capacity, row index), so "the fullest row that still fits" is one range query.
fn best_fit_decreasing(pieces: &[u32], seq_len: u32) -> Placement {
    let mut order: Vec<u32> = (0..pieces.len() as u32).collect();
    // Longest first; input order breaks ties so the result is deterministic.
    order.sort_unstable_by_key(|&i| (std::cmp::Reverse(pieces[i as usize]), i));

    let mut rows: Vec<Row> = Vec::new();
    let mut open: BTreeSet<(u32, u32)> = BTreeSet::new();
    let mut slots = vec![
        Slot {
            row: 0,
            col: 0,
            seg: 0
        };
        pieces.len()
    ];
    for i in order {
        let len = pieces[i as usize];
        let row = match open.range((len, 0)..).next().copied() {
            Some(key) => {
                open.remove(&key);
                key.1 as usize
            }
            None => {
                rows.push(Row { used: 0, pieces: 0 });
                rows.len() - 1
            }
        };
        slots[i as usize] = rows[row].push(row, len);
        let remaining = seq_len - rows[row].used;
        if remaining > 0 {
            open.insert((remaining, row as u32));
        }
    }
    Placement {
        rows: rows.len(),
        slots,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_falls_back_when_greedy_is_tighter() {
        // BFD packs 5,4 | 3,3,3 | 2 (3 rows); this input order packs 5,3,2 | 4,3,3 (2 rows).
        let pieces = [5, 3, 2, 4, 3, 3];
        assert_eq!(best_fit_decreasing(&pieces, 10).rows, 3);
        assert_eq!(greedy(&pieces, 10).rows, 2);
        assert_eq!(place(&pieces, 10, Strategy::BestFit).rows, 2);
    }

    #[test]
    fn best_fit_picks_the_fullest_row_that_fits() {
        // 6 and 5 open two rows (remaining 4 and 5); 4 goes to the row with 4 left.
        let p = best_fit_decreasing(&[6, 5, 4], 10);
        assert_eq!(p.rows, 2);
        assert_eq!(
            p.slots[2],
            Slot {
                row: 0,
                col: 6,
                seg: 1
            }
        );
    }
}
