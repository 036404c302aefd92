//! The tile: the unit of work of the engine's bf16 copy kernel (one thread block each).

use crate::Region2d;

/// The most elements one tile copies (64 KiB of bf16); a multiple of 8, so column splits keep
/// 16-byte alignment. Small tiles keep a launch's tail short: its last tiles run on a few blocks
/// while the rest of the GPU idles (512 KiB tiles cost ~0.13 ms per launch of 7.6 GB).
pub const TILE_ELEMS: usize = 1 << 15;

/// Bytes of one [`Tile`] as the copy kernel reads it.
pub const TILE_BYTES: usize = 40;

/// One unit of the copy kernel (one thread block): a 2-D copy of at most [`TILE_ELEMS`]
/// elements. Single-row tiles carry `src_ld = dst_ld = cols`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tile {
    /// First source element.
    pub src: u64,
    /// First destination element.
    pub dst: u64,
    /// Source row pitch.
    pub src_ld: u64,
    /// Destination row pitch.
    pub dst_ld: u64,
    /// Rows.
    pub rows: u32,
    /// Elements per row.
    pub cols: u32,
}

impl Tile {
    /// Elements copied.
    pub fn numel(&self) -> usize {
        self.rows as usize * self.cols as usize
    }

    /// Appends the kernel's view of the tile (`struct { u64 src, dst, src_ld, dst_ld; u32 rows,
    /// cols; }`, little-endian, [`TILE_BYTES`] bytes).
    pub fn write_bytes(&self, out: &mut Vec<u8>) {
        for v in [self.src, self.dst, self.src_ld, self.dst_ld] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.rows.to_le_bytes());
        out.extend_from_slice(&self.cols.to_le_bytes());
    }
}

/// Cuts the 2-D copy of `region` from element `src` to element `dst` into tiles: row blocks of
/// at most [`TILE_ELEMS`] elements, and rows longer than that into column blocks.
pub fn push_tiles(src: u64, dst: u64, region: Region2d, out: &mut Vec<Tile>) {
    let r = region;
    let max = TILE_ELEMS as u64;
    if r.cols >= max {
        for row in 0..r.rows {
            let mut c = 0;
            while c < r.cols {
                let n = max.min(r.cols - c);
                out.push(Tile {
                    src: src + row * r.src_ld + c,
                    dst: dst + row * r.dst_ld + c,
                    src_ld: n,
                    dst_ld: n,
                    rows: 1,
                    cols: n as u32,
                });
                c += n;
            }
        }
    } else if let Some(per) = max.checked_div(r.cols) {
        let per = per.max(1);
        let mut row = 0;
        while row < r.rows {
            let n = per.min(r.rows - row);
            let (src_ld, dst_ld) = if n == 1 {
                (r.cols, r.cols)
            } else {
                (r.src_ld, r.dst_ld)
            };
            out.push(Tile {
                src: src + row * r.src_ld,
                dst: dst + row * r.dst_ld,
                src_ld,
                dst_ld,
                rows: n as u32,
                cols: r.cols as u32,
            });
            row += n;
        }
    }
}
