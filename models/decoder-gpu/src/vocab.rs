//! The vocabulary rows of the logits: per-rank slices of `part` rows, the last ones possibly
//! padding (Megatron pads the vocabulary to a multiple of `multiple · T` with zero rows). The
//! decoder keeps only the real columns, so a padding row can never be sampled or picked by the
//! argmax. [`gather_vocab`] is the host mirror of the `gather_vocab` kernel.

/// `[T][m][part]` per-rank logits → `[m][vocab]`: `out[row][col] = g[col / part][row][col % part]`
/// for `col < vocab`; columns at or past `vocab` (padding rows of the last slices) are dropped.
/// `g` holds `T · m · part` values with `T = ⌈vocab / part⌉` or more. (The kernel's
/// specification; the tests check the index rule here.)
#[cfg(test)]
pub(crate) fn gather_vocab(g: &[f32], m: usize, part: usize, vocab: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * vocab);
    for row in 0..m {
        for col in 0..vocab {
            let (r, c) = (col / part, col % part);
            out.push(g[(r * m + row) * part + c]);
        }
    }
    out
}

/// Whether the logits need [`gather_vocab`] (the rows are padded, so `T · part != vocab`), or
/// are already `[m][vocab]` (one rank) or the plain all-gather order (`unshard`).
pub(crate) fn padded(tp: usize, part: usize, vocab: usize) -> bool {
    tp * part != vocab
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_decoder::argmax;

    #[test]
    fn padding_columns_are_dropped_and_never_picked() {
        // vocab 7 padded to 8 over T = 2: part 4, the last row of rank 1 is padding
        let (m, part, vocab) = (2, 4, 7);
        let mut g = Vec::new();
        for r in 0..2 {
            for row in 0..m {
                for c in 0..part {
                    let col = r * part + c;
                    // padding gets the largest value: it must never win
                    g.push(if col >= vocab {
                        1e9
                    } else {
                        (row * 100 + col) as f32
                    });
                }
            }
        }
        let out = gather_vocab(&g, m, part, vocab);
        assert_eq!(out.len(), m * vocab);
        for row in 0..m {
            let want: Vec<f32> = (0..vocab).map(|col| (row * 100 + col) as f32).collect();
            assert_eq!(&out[row * vocab..(row + 1) * vocab], want.as_slice());
            assert_eq!(argmax(&out[row * vocab..(row + 1) * vocab]), vocab - 1);
        }
        assert!(padded(2, 4, 7));
        assert!(!padded(2, 4, 8));
    }

    #[test]
    fn one_rank_with_padding_keeps_the_first_vocab_columns() {
        // T = 1: vocab 5 padded to 8
        let (m, part, vocab) = (3, 8, 5);
        let g: Vec<f32> = (0..m * part).map(|i| i as f32).collect();
        let out = gather_vocab(&g, m, part, vocab);
        for row in 0..m {
            let want: Vec<f32> = (0..vocab).map(|c| (row * part + c) as f32).collect();
            assert_eq!(&out[row * vocab..(row + 1) * vocab], want.as_slice());
        }
        assert!(padded(1, 8, 5));
        assert!(!padded(1, 5, 5));
    }

    #[test]
    fn unpadded_slices_match_the_plain_unshard_order() {
        let (tp, m, part) = (3, 2, 4);
        let vocab = tp * part;
        let g: Vec<f32> = (0..tp * m * part).map(|i| i as f32).collect();
        let out = gather_vocab(&g, m, part, vocab);
        // unshard: out[row][r·part + c] = g[r][row][c]
        for r in 0..tp {
            for row in 0..m {
                for c in 0..part {
                    assert_eq!(out[row * vocab + r * part + c], g[(r * m + row) * part + c]);
                }
            }
        }
    }
}
