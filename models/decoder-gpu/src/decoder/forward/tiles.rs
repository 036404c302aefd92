//! The row tiles of a prefill's attention (`attention_tiled*`): runs of rows of one sequence at
//! consecutive positions, at most [`TILE_ROWS`] each, so that one block reads a page of K and V
//! once for all of its tile's rows.

use crate::kernels::TILE_ROWS;

/// The tiles of a pass whose row `r` is sequence `seqs[r]` at position `poss[r]`: `[first row,
/// rows]` per tile, in row order, each tile's rows consecutive rows of one sequence at
/// consecutive positions (a run breaks where either changes otherwise), at most [`TILE_ROWS`].
pub(crate) fn prefill_tiles(seqs: &[u32], poss: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut first = 0usize;
    for r in 0..seqs.len().min(poss.len()) {
        let joins = r > first
            && r - first < TILE_ROWS
            && seqs[r] == seqs[r - 1]
            && poss[r] == poss[r - 1].wrapping_add(1);
        if r > first && !joins {
            out.extend([first as u32, (r - first) as u32]);
            first = r;
        }
    }
    let n = seqs.len().min(poss.len());
    if n > first {
        out.extend([first as u32, (n - first) as u32]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_one_sequence_at_consecutive_positions_make_tiles() {
        let seqs: Vec<u32> = [0u32; 20].into_iter().chain([1, 2]).collect();
        let poss: Vec<u32> = (0..20).chain([7, 9]).collect();
        assert_eq!(prefill_tiles(&seqs, &poss), [0, 16, 16, 4, 20, 1, 21, 1]);
        // a gap in the positions, and the same position again, break a run
        assert_eq!(
            prefill_tiles(&[3, 3, 3, 3], &[0, 1, 3, 3]),
            [0, 2, 2, 1, 3, 1]
        );
        // two sequences back to back
        assert_eq!(prefill_tiles(&[0, 0, 1, 1], &[5, 6, 0, 1]), [0, 2, 2, 2]);
        assert!(prefill_tiles(&[], &[]).is_empty());
    }

    #[test]
    fn every_row_is_in_one_tile() {
        let seqs: Vec<u32> = (0..100u32).map(|r| r / 37).collect();
        let poss: Vec<u32> = (0..100u32).map(|r| r % 37 + 5).collect();
        let t = prefill_tiles(&seqs, &poss);
        let mut next = 0;
        for pair in t.chunks(2) {
            assert_eq!(pair[0], next);
            assert!((1..=TILE_ROWS as u32).contains(&pair[1]));
            let rows = pair[0] as usize..(pair[0] + pair[1]) as usize;
            assert!(rows.clone().all(|r| seqs[r] == seqs[rows.start]));
            assert!(rows
                .clone()
                .all(|r| poss[r] == poss[rows.start] + (r - rows.start) as u32));
            next += pair[1];
        }
        assert_eq!(next, 100);
    }
}
