//! Strided 2-D regions of flat buffers, the unit every copy and cast step names.

/// A strided 2-D region: `rows` × `cols` elements, row pitches `src_ld` / `dst_ld` in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region2d {
    /// Rows.
    pub rows: u64,
    /// Elements per row.
    pub cols: u64,
    /// Source row pitch in elements.
    pub src_ld: u64,
    /// Destination row pitch in elements.
    pub dst_ld: u64,
}

impl Region2d {
    /// One dense row of `n` elements.
    pub fn flat(n: u64) -> Region2d {
        Region2d {
            rows: 1,
            cols: n,
            src_ld: n,
            dst_ld: n,
        }
    }

    /// Elements in the region.
    pub fn numel(&self) -> u64 {
        self.rows * self.cols
    }

    /// The same region as one row when both sides are dense (`src_ld == dst_ld == cols`).
    pub fn normalized(self) -> Region2d {
        if self.rows > 1 && self.src_ld == self.cols && self.dst_ld == self.cols {
            let n = self.rows * self.cols;
            Region2d {
                rows: 1,
                cols: n,
                src_ld: n,
                dst_ld: n,
            }
        } else {
            self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_normalization_flattens_dense_regions() {
        let r = Region2d {
            rows: 3,
            cols: 4,
            src_ld: 4,
            dst_ld: 4,
        };
        assert_eq!(r.normalized().rows, 1);
        assert_eq!(r.normalized().cols, 12);
        let s = Region2d { src_ld: 8, ..r };
        assert_eq!(s.normalized(), s);
    }
}
