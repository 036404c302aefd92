//! A Megatron [`RankSchedule`] as [`RankSteps`]: the local tiles and bulk runs in chunks that
//! interleave with the network steps, each step's pack / send-receive / unpack, or with peer
//! copies one step of pushes and remote tiles.

use std::ops::Range;

use super::schedule::{Place, RankSchedule, Run, Tile};
use crate::steps::{
    Buf, Copy, Engine, LocalChunk, Message, NetStep, PeerRun, RankSteps, SourceType, Stream,
};
use crate::{LayoutError, Region2d};

/// The buffers a rank's steps run over, and how they are issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Ranks of the switch.
    pub world: usize,
    /// Elements of the rank's bf16 parameter buffer.
    pub source_elems: u64,
    /// Elements of every rank's rollout buffer.
    pub rollout_elems: u64,
    /// Steps in flight (send and receive slots of each).
    pub in_flight: usize,
    /// Whether remote runs travel as peer copies (the schedule was built for them).
    pub peer_copy: bool,
    /// With peer copies, run the driver's copies of large local runs on the compute stream
    /// beside the tile kernel on the auxiliary one.
    pub split_local_bulk: bool,
}

fn tile_copy(t: &Tile, src: Buf, dst: Buf) -> Copy {
    Copy::kernel(
        src,
        t.src,
        dst,
        t.dst,
        Region2d {
            rows: t.rows as u64,
            cols: t.cols as u64,
            src_ld: t.src_ld,
            dst_ld: t.dst_ld,
        },
    )
}

fn region(r: &Run) -> Region2d {
    Region2d {
        rows: r.rows as u64,
        cols: r.cols as u64,
        src_ld: r.src_ld as u64,
        dst_ld: r.dst_ld as u64,
    }
}

fn bulk_copy(r: &Run) -> Copy {
    Copy {
        engine: Engine::Driver,
        ..Copy::kernel(
            Buf::Source,
            r.src as u64,
            Buf::Rollout,
            r.dst as u64,
            region(r),
        )
    }
}

impl RankSchedule {
    /// This schedule as steps over the buffers of `shape`.
    ///
    /// With NCCL steps, local chunk `j` (of as many as there are steps) is issued after step
    /// `j`'s network work and gives way to the pack of step `j + 1`; with no step, one chunk is
    /// issued first. With peer copies (pushes or remote tiles), one step holds them and the local
    /// work is issued first (tiles on the auxiliary stream, large runs on the compute stream when
    /// split).
    pub fn rank_steps(&self, shape: StepShape) -> Result<RankSteps, LayoutError> {
        let mut copies = Vec::new();
        let mut local = Vec::new();
        let mut steps = Vec::new();
        let tiles = |copies: &mut Vec<Copy>, r: Range<usize>, src, dst| -> Range<usize> {
            let start = copies.len();
            copies.extend(self.tiles[r].iter().map(|t| tile_copy(t, src, dst)));
            start..copies.len()
        };
        let remote_work = !self.pushes.is_empty() || !self.peer_tiles.is_empty();
        if shape.peer_copy || self.steps.is_empty() {
            let start = copies.len();
            tiles(&mut copies, self.local.clone(), Buf::Source, Buf::Rollout);
            let tiled = start..copies.len();
            copies.extend(self.local_bulk.iter().map(bulk_copy));
            let chunk = |r: Range<usize>, stream| LocalChunk {
                overlap: remote_work,
                ..LocalChunk::upfront(r, stream)
            };
            if shape.peer_copy && shape.split_local_bulk {
                local.push(chunk(tiled.clone(), Stream::Aux));
                if copies.len() > tiled.end {
                    local.push(chunk(tiled.end..copies.len(), Stream::Compute));
                }
            } else {
                local.push(chunk(start..copies.len(), Stream::Aux));
            }
            if remote_work {
                let remote = self
                    .peer_tiles
                    .iter()
                    .map(|(peer, r)| {
                        let c = tiles(&mut copies, r.clone(), Buf::Source, Buf::Rollout);
                        (*peer, c)
                    })
                    .collect();
                steps.push(NetStep {
                    index: 0,
                    pushes: self
                        .pushes
                        .iter()
                        .map(|p| PeerRun {
                            peer: p.peer,
                            src: Buf::Source,
                            src_off: p.run.src as u64,
                            dst_off: p.run.dst as u64,
                            region: region(&p.run),
                        })
                        .collect(),
                    remote,
                    recv_elems: self.recv_elems as u64,
                    ..NetStep::default()
                });
            }
        } else {
            let n = self.steps.len();
            for (j, (t, b)) in self.local_chunks(n).into_iter().enumerate() {
                let start = copies.len();
                tiles(&mut copies, t, Buf::Source, Buf::Rollout);
                copies.extend(self.local_bulk[b].iter().map(bulk_copy));
                local.push(LocalChunk {
                    copies: start..copies.len(),
                    stream: Stream::Aux,
                    after_step: Some(j),
                    gate: Some((j + 1).min(n - 1)),
                    overlap: true,
                });
            }
            for st in &self.steps {
                let msg = |m: &super::schedule::Message, slot: Buf, buffer: Buf| {
                    let (buf, off) = match m.place {
                        Place::Slot(o) => (slot, o),
                        Place::Buffer(o) => (buffer, o),
                    };
                    Message {
                        peer: m.peer,
                        buf,
                        off: off as u64,
                        count: m.count as u64,
                    }
                };
                steps.push(NetStep {
                    index: st.step,
                    pack: tiles(&mut copies, st.pack.clone(), Buf::Source, Buf::SendSlot),
                    unpack: tiles(&mut copies, st.unpack.clone(), Buf::RecvSlot, Buf::Rollout),
                    sends: st
                        .sends
                        .iter()
                        .map(|m| msg(m, Buf::SendSlot, Buf::Source))
                        .collect(),
                    recvs: st
                        .recvs
                        .iter()
                        .map(|m| msg(m, Buf::RecvSlot, Buf::Rollout))
                        .collect(),
                    recv_elems: st.recv_elems as u64,
                    ..NetStep::default()
                });
            }
        }
        let n = steps.len();
        let steps = RankSteps {
            rank: self.rank,
            world: shape.world,
            source: SourceType::Bf16,
            copies,
            quantise: Vec::new(),
            agree: None,
            zero: self
                .zero
                .iter()
                .map(|z| z.start as u64..z.end as u64)
                .collect(),
            local,
            steps,
            in_flight: shape.in_flight.max(1).min(n.max(1)),
            send_slot_elems: self.send_slot_elems as u64,
            recv_slot_elems: self.recv_slot_elems as u64,
            source_elems: shape.source_elems,
            rollout_elems: shape.rollout_elems,
            local_elems: self.local_elems as u64,
            recv_elems: self.recv_elems as u64,
        };
        steps.validate()?;
        Ok(steps)
    }
}
