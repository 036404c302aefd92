//! [`EntryTable`]: where every local rank's rollout tensors sit in its buffer, shared between
//! the rollouts of one plan, with the furthest tensor's end found once.

use std::sync::Arc;

use lifecycle_layout::RolloutEntry;

use crate::CudaError;

/// Every local rank's rollout tensors (`[i]` for the `i`-th local rank), shared without copying
/// between the rollouts a backend makes from one plan, with the tensor that ends furthest into
/// its buffer found when the table is made: checking a table against a buffer length
/// ([`RolloutBuffer::per_rank_shared`](crate::RolloutBuffer::per_rank_shared)) costs nothing per
/// tensor, where a walk over 3 000 tensors costs tens of microseconds of every switch.
///
/// ```
/// use lifecycle_cuda::EntryTable;
/// use lifecycle_layout::RolloutEntry;
///
/// let a = RolloutEntry::new("a", vec![4, 8], 0);
/// let b = RolloutEntry::new("b", vec![16], 32);
/// let table = EntryTable::new(vec![vec![a, b.clone()], vec![b]]);
/// assert_eq!(table.end(), 48);
/// assert_eq!(table.ranks().len(), 2);
/// assert!(table.check_fits(48).is_ok());
/// let err = table.check_fits(40).unwrap_err().to_string();
/// assert!(err.contains("`b`") && err.contains("48"), "{err}");
/// ```
#[derive(Debug, Clone)]
pub struct EntryTable {
    ranks: Arc<Vec<Vec<RolloutEntry>>>,
    /// The furthest-ending tensor: `(local rank index, entry index)`, `None` without tensors.
    furthest: Option<(usize, usize)>,
    end: usize,
}

impl EntryTable {
    /// The table of `ranks` (one entry list per local rank), its furthest end found now.
    pub fn new(ranks: Vec<Vec<RolloutEntry>>) -> Self {
        let mut furthest = None;
        let mut end = 0;
        for (i, list) in ranks.iter().enumerate() {
            for (j, e) in list.iter().enumerate() {
                if furthest.is_none() || e.range().end > end {
                    end = e.range().end;
                    furthest = Some((i, j));
                }
            }
        }
        EntryTable {
            ranks: Arc::new(ranks),
            furthest,
            end,
        }
    }

    /// Every local rank's entries, in local-rank order.
    pub fn ranks(&self) -> &[Vec<RolloutEntry>] {
        &self.ranks
    }

    /// The element every tensor of every rank ends at or before (0 without tensors).
    pub fn end(&self) -> usize {
        self.end
    }

    /// `Ok` when every tensor lies inside a buffer of `len` elements; otherwise
    /// [`CudaError::Invalid`] naming the tensor that ends furthest past it.
    pub fn check_fits(&self, len: usize) -> Result<(), CudaError> {
        match self.furthest {
            Some((i, j)) if self.end > len => {
                let name = self.ranks[i][j].name();
                Err(CudaError::Invalid(format!(
                    "rollout tensor `{name}` ends at element {}, past the buffer's {len}",
                    self.end
                )))
            }
            _ => Ok(()),
        }
    }
}

impl From<Vec<Vec<RolloutEntry>>> for EntryTable {
    fn from(ranks: Vec<Vec<RolloutEntry>>) -> Self {
        EntryTable::new(ranks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_furthest_end_is_found_on_any_rank_and_named_when_it_does_not_fit() {
        let e = |name: &str, n: usize, at: usize| RolloutEntry::new(name, vec![n], at);
        let fp8 = RolloutEntry::fp8("w", vec![128, 256], 100);
        let t = EntryTable::new(vec![
            vec![e("a", 10, 0), e("b", 5, 10)],
            vec![e("c", 50, 0), fp8.clone()],
        ]);
        assert_eq!(t.end(), fp8.range().end);
        assert!(t.check_fits(fp8.range().end).is_ok());
        let err = t.check_fits(fp8.range().end - 1).unwrap_err().to_string();
        assert!(err.contains("`w`"), "{err}");
        let empty = EntryTable::new(vec![Vec::new(), Vec::new()]);
        assert_eq!(empty.end(), 0);
        assert!(empty.check_fits(0).is_ok());
        assert_eq!(empty.ranks().len(), 2);
    }
}
