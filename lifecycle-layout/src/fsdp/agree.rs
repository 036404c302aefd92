//! An fp8 FSDP plan at W > 1 as steps: the scale grid of every quantised tensor, each rank's
//! partial amaxes (the rows it holds), the pieces it quantises with the agreed scales (its own
//! straight into its rollout buffer; those it sends from its rollout buffer when it holds the
//! same bytes, from the fp8 stage otherwise), the scale copies, and one network step that moves
//! the e4m3 bytes ([`Fp8Agree`]).

use std::collections::BTreeMap;

use super::{align, FsdpPlan};
use crate::fp8::FP8_BLOCK;
use crate::plan::Piece;
use crate::steps::{AgreedQuantise, Buf, Copy, Fp8Agree, GridRegion, Message, NetStep, PeerRun};
use crate::{LayoutError, Region2d};

use super::fp8::Fp8Slice;

/// Where one quantised tensor's blocks sit in the scale grid.
#[derive(Debug, Clone, Copy)]
struct Grid {
    base: u64,
    cols: u64,
}

/// What [`FsdpPlan::rank_agree`] adds to a rank's steps.
pub(super) struct AgreedSteps {
    pub agree: Fp8Agree,
    /// The network step moving the bytes, if any rank sends any.
    pub step: Option<NetStep>,
    /// bf16-sized elements the rank receives in it.
    pub recv_elems: u64,
}

impl FsdpPlan {
    /// The scale grid: per quantised tensor (rollout index), its first entry and blocks per row.
    fn fp8_grid(&self) -> (BTreeMap<usize, Grid>, u64) {
        let mut grid = BTreeMap::new();
        let mut total = 0u64;
        let mut tensors: Vec<(usize, usize)> = self
            .fp8
            .iter()
            .flatten()
            .map(|s| (s.tensor.tensor, s.tensor.train_index))
            .collect();
        tensors.sort_unstable();
        tensors.dedup();
        for (j, ti) in tensors {
            let slot = &self.shards.slots[ti];
            let rows = slot.shape.first().copied().unwrap_or(1) as u64;
            let b = FP8_BLOCK as u64;
            let cols = (slot.cols as u64).div_ceil(b);
            grid.insert(j, Grid { base: total, cols });
            total += rows.div_ceil(b) * cols;
        }
        (grid, total)
    }

    /// Rank `rank`'s part in the agreed fp8 switch (W > 1), its copies appended to `copies`;
    /// the network step is numbered `index`. Pieces that cross ranks must be whole rows of
    /// their slice at even byte offsets and lengths (they move as 2-byte elements): a piece that
    /// is not is refused naming its tensor.
    pub(super) fn rank_agree(
        &self,
        rank: usize,
        index: usize,
        copies: &mut Vec<Copy>,
    ) -> Result<AgreedSteps, LayoutError> {
        let bad = |what: String| LayoutError::InvalidSteps { rank, what };
        let (grid, grid_elems) = self.fp8_grid();
        let grid_of = |s: &Fp8Slice| {
            grid.get(&s.tensor.tensor)
                .copied()
                .ok_or_else(|| bad(format!("`{}` has no scale grid", s.entry.name())))
        };
        let region = |p: &Piece, s: &Fp8Slice, g: Grid| -> Result<GridRegion, LayoutError> {
            let ti = s.tensor.train_index;
            let slot = &self.shards.slots[ti];
            let held = self.shards.held_rows(ti, p.src_rank);
            if !p.cols.start.is_multiple_of(FP8_BLOCK) || p.rows.start < held.start {
                return Err(bad(format!(
                    "a piece of `{}` (rows {:?}, columns {:?}) starts inside a block column or \
                     outside rank {}'s rows {held:?}",
                    slot.name, p.rows, p.cols, p.src_rank
                )));
            }
            Ok(GridRegion {
                src_off: slot.offset
                    + ((p.rows.start - held.start) * slot.cols + p.cols.start) as u64,
                src_ld: slot.cols as u64,
                rows: p.rows.len() as u64,
                cols: p.cols.len() as u64,
                grid: g.base,
                grid_cols: g.cols,
                row0: p.rows.start as u64,
                col_block0: (p.cols.start / FP8_BLOCK) as u64,
            })
        };
        // The byte a piece starts at in a slice's rollout entry (whole rows of the slice only).
        let place =
            |p: &Piece, s: &Fp8Slice| -> Result<u64, LayoutError> {
                if p.cols != s.tensor.cols {
                    return Err(bad(format!(
                        "a piece of `{}` covers columns {:?} of the slice's {:?}: fp8 pieces are \
                     whole rows of their slice",
                        s.entry.name(),
                        p.cols,
                        s.tensor.cols
                    )));
                }
                Ok(2 * s.entry.offset() as u64
                    + s.tensor.dst_offset(p.rows.start, p.cols.start) as u64)
            };
        let even = |byte: u64, bytes: u64, s: &Fp8Slice| {
            if byte.is_multiple_of(2) && bytes.is_multiple_of(2) {
                Ok(())
            } else {
                Err(bad(format!(
                    "`{}` would cross ranks as {bytes} e4m3 bytes at byte {byte} of a rollout \
                     buffer; fp8 at W > 1 moves 2-byte elements, so this shard split needs an \
                     even byte count and offset (an even number of columns, or keep the tensor \
                     bf16 with Fp8Keep)",
                    s.entry.name()
                )))
            }
        };

        let mut agree = Fp8Agree {
            grid_elems,
            ..Fp8Agree::default()
        };
        // partial amaxes: the held rows of every quantised tensor
        let mut seen = std::collections::BTreeSet::new();
        for s in self.fp8.iter().flatten() {
            if !seen.insert(s.tensor.tensor) {
                continue;
            }
            let ti = s.tensor.train_index;
            let slot = &self.shards.slots[ti];
            let held = self.shards.held_rows(ti, rank);
            if held.is_empty() {
                continue;
            }
            let g = grid_of(s)?;
            agree.amax.push(GridRegion {
                src_off: slot.offset,
                src_ld: slot.cols as u64,
                rows: held.len() as u64,
                cols: slot.cols as u64,
                grid: g.base,
                grid_cols: g.cols,
                row0: held.start as u64,
                col_block0: 0,
            });
        }

        // own pieces, straight into the rollout buffer; the scales of every own slice
        let own = self.fp8.get(rank).map_or(&[][..], Vec::as_slice);
        let s0 = copies.len();
        for s in own {
            let g = grid_of(s)?;
            for p in s
                .tensor
                .pieces
                .iter()
                .filter(|p| p.src_rank == rank && p.numel() > 0)
            {
                agree.quantise.push(AgreedQuantise {
                    region: region(p, s, g)?,
                    dst: Buf::Rollout,
                    dst_byte: place(p, s)?,
                });
            }
            let t = &s.tensor;
            let b = FP8_BLOCK;
            if !t.rows.start.is_multiple_of(b) || !t.cols.start.is_multiple_of(b) {
                return Err(bad(format!(
                    "the fp8 slice of `{}` cuts a block",
                    s.entry.name()
                )));
            }
            let scale = s.entry.scale_offset().ok_or_else(|| {
                bad(format!(
                    "the fp8 slice of `{}` has no scales",
                    s.entry.name()
                ))
            })?;
            let (rb, cb) = (
                t.rows.len().div_ceil(b) as u64,
                t.cols.len().div_ceil(b) as u64,
            );
            let first = g.base + (t.rows.start / b) as u64 * g.cols + (t.cols.start / b) as u64;
            copies.push(Copy::kernel(
                Buf::Scales,
                2 * first,
                Buf::Rollout,
                scale as u64,
                Region2d {
                    rows: rb,
                    cols: 2 * cb,
                    src_ld: 2 * g.cols,
                    dst_ld: 2 * cb,
                },
            ));
        }
        agree.scale_copies = s0..copies.len();

        // what crosses ranks
        let crosses = self.fp8.iter().enumerate().any(|(d, slices)| {
            slices
                .iter()
                .any(|s| s.tensor.pieces.iter().any(|p| p.src_rank != d))
        });
        if !crosses {
            return Ok(AgreedSteps {
                agree,
                step: None,
                recv_elems: 0,
            });
        }
        let mut st = NetStep {
            index,
            ..NetStep::default()
        };
        let mut stage = 0u64;
        for (d, slices) in self.fp8.iter().enumerate().filter(|(d, _)| *d != rank) {
            for s in slices {
                let g = grid_of(s)?;
                for p in s
                    .tensor
                    .pieces
                    .iter()
                    .filter(|p| p.src_rank == rank && p.numel() > 0)
                {
                    let bytes = p.numel() as u64;
                    let at = place(p, s)?;
                    even(at, bytes, s)?;
                    // the same bytes in this rank's own slice of the tensor, if it has them
                    let mine = own.iter().find(|o| {
                        o.tensor.tensor == s.tensor.tensor
                            && o.tensor.cols == p.cols
                            && o.tensor.rows.start <= p.rows.start
                            && p.rows.end <= o.tensor.rows.end
                    });
                    let (buf, from) = match mine {
                        Some(o) => (Buf::Rollout, place(p, o)?),
                        None => {
                            let byte = 2 * align(stage);
                            stage = byte / 2 + bytes.div_ceil(2);
                            agree.quantise.push(AgreedQuantise {
                                region: region(p, s, g)?,
                                dst: Buf::Fp8Stage,
                                dst_byte: byte,
                            });
                            (Buf::Fp8Stage, byte)
                        }
                    };
                    even(from, bytes, s)?;
                    if self.peer_copy {
                        st.pushes.push(PeerRun {
                            peer: d,
                            src: buf,
                            src_off: from / 2,
                            dst_off: at / 2,
                            region: Region2d::flat(bytes / 2),
                        });
                    } else {
                        st.sends.push(Message {
                            peer: d,
                            buf,
                            off: from / 2,
                            count: bytes / 2,
                        });
                    }
                }
            }
        }
        agree.stage_elems = if stage > 0 { align(stage) } else { 0 };
        for s in own {
            for p in s
                .tensor
                .pieces
                .iter()
                .filter(|p| p.src_rank != rank && p.numel() > 0)
            {
                let (at, bytes) = (place(p, s)?, p.numel() as u64);
                even(at, bytes, s)?;
                st.recv_elems += bytes / 2;
                if !self.peer_copy {
                    st.recvs.push(Message {
                        peer: p.src_rank,
                        buf: Buf::Rollout,
                        off: at / 2,
                        count: bytes / 2,
                    });
                }
            }
        }
        agree.step = Some(index);
        let recv_elems = st.recv_elems;
        Ok(AgreedSteps {
            agree,
            step: Some(st),
            recv_elems,
        })
    }
}
