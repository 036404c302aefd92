//! Steps compiled into the stream operations and events an executor issues, in issue order.
//!
//! One schedule for every layout:
//! - the compute stream's earlier work (allocations, uploads) is ordered before the other
//!   streams; the zero ranges and the upfront local chunks go to their streams first;
//! - the packs of the first `in_flight` steps are issued ahead; step `j`'s network work waits
//!   for its pack (and for the local chunk it reads, if any), then its unpack waits for the
//!   network work; the pack of step `j + in_flight`, which reuses step `j`'s slots, is issued
//!   only after the compute stream waited for step `j`'s network work;
//! - local chunks issued after a step wait for the pack they give way to;
//! - an agreed fp8 switch ([`Fp8Agree`](super::Fp8Agree)) issues its partial amaxes first on
//!   the auxiliary stream and its agreement first on the network stream (after them); its
//!   quantisation and scale copies go to the auxiliary stream (after the agreement) just before
//!   the network step that sends the bytes, which waits for them;
//! - at the end the compute stream waits for the network and auxiliary streams.

use std::ops::Range;

use super::{RankSteps, Stream};
use crate::LayoutError;

/// What a run of copies is for (executors name its span from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyRole {
    /// Local chunk `c` (its position in [`RankSteps::local`]).
    Local(usize),
    /// The pack of the step numbered `index`.
    Pack(usize),
    /// The unpack of the step numbered `index`.
    Unpack(usize),
    /// Copies of the step numbered `index` written into rank `peer`'s rollout buffer.
    Remote {
        /// The step's number.
        index: usize,
        /// The destination rank.
        peer: usize,
    },
    /// The agreed fp8 scales copied into the rollout buffer.
    Scales,
}

/// One operation of a [`Program`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Zero [`RankSteps::zero`] on the auxiliary stream.
    Zero,
    /// Run copies `copies` on `stream`; slot buffers are slot `slot`'s; with `peer`, rollout
    /// destinations are that rank's rollout buffer.
    Copies {
        /// The stream.
        stream: Stream,
        /// The copies (a range of [`RankSteps::copies`]).
        copies: Range<usize>,
        /// Staging slot index.
        slot: usize,
        /// Destination rank for remote copies.
        peer: Option<usize>,
        /// Shares the GPU with network copies.
        overlap: bool,
        /// What the copies are for.
        role: CopyRole,
    },
    /// The grouped NCCL sends and receives, then the all-gathers, of step `step` (position),
    /// on the network stream, with staging slot `slot`.
    Nccl {
        /// Position in [`RankSteps::steps`].
        step: usize,
        /// Staging slot index.
        slot: usize,
    },
    /// Peer copies `runs` (a range of the step's pushes, all to `peer`) on the network stream.
    Push {
        /// Position in [`RankSteps::steps`].
        step: usize,
        /// The destination rank.
        peer: usize,
        /// A range of the step's [`super::NetStep::pushes`].
        runs: Range<usize>,
        /// Staging slot index.
        slot: usize,
    },
    /// The quantisations of [`RankSteps::quantise`] (all of them), on the auxiliary stream.
    Quantise,
    /// The partial amaxes of [`RankSteps::agree`] into the zeroed scale grid, on the auxiliary
    /// stream.
    Amax,
    /// The agreement of [`RankSteps::agree`]: the scale grid all-reduced by max across every
    /// rank, then turned into `scale_inv`s, on the network stream (a collective: every rank
    /// issues it).
    Agree,
    /// The agreed quantisations of [`RankSteps::agree`], on the auxiliary stream.
    QuantiseAgreed,
    /// Record event `event` on `stream` (each event is recorded once).
    Record {
        /// The stream.
        stream: Stream,
        /// The event.
        event: usize,
    },
    /// Make `stream` wait for event `event` (recorded by an earlier operation).
    Wait {
        /// The stream.
        stream: Stream,
        /// The event.
        event: usize,
    },
}

/// A rank's switch as stream operations in issue order (see [`compile`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Program {
    ops: Vec<Op>,
    events: usize,
}

impl Program {
    /// The operations, in issue order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// Events the program records.
    pub fn events(&self) -> usize {
        self.events
    }

    /// The program with every operation `keep` refuses removed (events keep their numbers):
    /// for tests that show an executor notices a missing dependency.
    pub fn without(&self, mut keep: impl FnMut(usize, &Op) -> bool) -> Program {
        Program {
            ops: self
                .ops
                .iter()
                .enumerate()
                .filter(|(i, op)| keep(*i, op))
                .map(|(_, op)| op.clone())
                .collect(),
            events: self.events,
        }
    }

    fn record(&mut self, stream: Stream) -> usize {
        let event = self.events;
        self.events += 1;
        self.ops.push(Op::Record { stream, event });
        event
    }

    fn wait(&mut self, stream: Stream, event: usize) {
        self.ops.push(Op::Wait { stream, event });
    }
}

/// Compiles a rank's validated steps into its [`Program`].
pub fn compile(steps: &RankSteps) -> Result<Program, LayoutError> {
    steps.validate()?;
    let bad = |what: String| LayoutError::InvalidSteps {
        rank: steps.rank,
        what,
    };
    let mut p = Program::default();
    let n = steps.steps.len();
    let f = steps.in_flight.max(1);
    let start = p.record(Stream::Compute);
    p.wait(Stream::Net, start);
    p.wait(Stream::Aux, start);
    if !steps.zero.is_empty() {
        p.ops.push(Op::Zero);
    }
    // The agreement: partial amaxes, then the all-reduce, ahead of every other stream's work.
    let agreed = match &steps.agree {
        Some(_) => {
            p.ops.push(Op::Amax);
            let amax = p.record(Stream::Aux);
            p.wait(Stream::Net, amax);
            p.ops.push(Op::Agree);
            Some(p.record(Stream::Net))
        }
        None => None,
    };
    // The agreed quantisation and scale copies on the auxiliary stream; the event they record.
    let quantise_agreed = |p: &mut Program, agreed: usize| {
        p.wait(Stream::Aux, agreed);
        p.ops.push(Op::QuantiseAgreed);
        if let Some(a) = &steps.agree
            && !a.scale_copies.is_empty()
        {
            p.ops.push(Op::Copies {
                stream: Stream::Aux,
                copies: a.scale_copies.clone(),
                slot: 0,
                peer: None,
                overlap: false,
                role: CopyRole::Scales,
            });
        }
        p.record(Stream::Aux)
    };
    let mut agreed_pending = agreed;
    let mut packed: Vec<usize> = Vec::with_capacity(n);
    let mut local_done: Vec<Option<usize>> = vec![None; steps.local.len()];
    let pack = |p: &mut Program, packed: &mut Vec<usize>, j: usize| {
        let st = &steps.steps[j];
        if !st.pack.is_empty() {
            p.ops.push(Op::Copies {
                stream: Stream::Compute,
                copies: st.pack.clone(),
                slot: j % f,
                peer: None,
                overlap: true,
                role: CopyRole::Pack(st.index),
            });
        }
        packed.push(p.record(Stream::Compute));
        for (peer, copies) in &st.remote {
            if !copies.is_empty() {
                p.ops.push(Op::Copies {
                    stream: Stream::Compute,
                    copies: copies.clone(),
                    slot: j % f,
                    peer: Some(*peer),
                    overlap: false,
                    role: CopyRole::Remote {
                        index: st.index,
                        peer: *peer,
                    },
                });
            }
        }
    };
    let local = |p: &mut Program, done: &mut [Option<usize>], packed: &[usize], c: usize| {
        let chunk = &steps.local[c];
        if let Some(g) = chunk.gate {
            let Some(&e) = packed.get(g) else {
                return Err(bad(format!(
                    "local chunk {c} gives way to the pack of step {g}, which is issued after it"
                )));
            };
            p.wait(chunk.stream, e);
        }
        if !chunk.copies.is_empty() {
            p.ops.push(Op::Copies {
                stream: chunk.stream,
                copies: chunk.copies.clone(),
                slot: 0,
                peer: None,
                overlap: chunk.overlap,
                role: CopyRole::Local(c),
            });
        }
        done[c] = Some(p.record(chunk.stream));
        Ok(())
    };
    for j in 0..f.min(n) {
        pack(&mut p, &mut packed, j);
    }
    for c in (0..steps.local.len()).filter(|&c| steps.local[c].after_step.is_none()) {
        local(&mut p, &mut local_done, &packed, c)?;
    }
    for j in 0..n {
        let st = &steps.steps[j];
        p.wait(Stream::Net, packed[j]);
        if steps.agree.as_ref().and_then(|a| a.step) == Some(j)
            && let Some(agreed) = agreed_pending.take()
        {
            let done = quantise_agreed(&mut p, agreed);
            p.wait(Stream::Net, done);
        }
        if let Some(c) = st.wait_local {
            let Some(e) = local_done[c] else {
                return Err(bad(format!(
                    "step {j} waits for local chunk {c}, which is issued after it"
                )));
            };
            p.wait(Stream::Net, e);
        }
        if st.has_nccl() {
            p.ops.push(Op::Nccl {
                step: j,
                slot: j % f,
            });
        }
        let mut i = 0;
        while i < st.pushes.len() {
            let peer = st.pushes[i].peer;
            let end = st.pushes[i..]
                .iter()
                .position(|r| r.peer != peer)
                .map_or(st.pushes.len(), |k| i + k);
            p.ops.push(Op::Push {
                step: j,
                peer,
                runs: i..end,
                slot: j % f,
            });
            i = end;
        }
        let net = p.record(Stream::Net);
        let mut waited = false;
        if !st.unpack.is_empty() {
            p.wait(Stream::Compute, net);
            waited = true;
            p.ops.push(Op::Copies {
                stream: Stream::Compute,
                copies: st.unpack.clone(),
                slot: j % f,
                peer: None,
                overlap: true,
                role: CopyRole::Unpack(st.index),
            });
        }
        if j + f < n {
            if !waited {
                p.wait(Stream::Compute, net);
            }
            pack(&mut p, &mut packed, j + f);
        }
        for c in (0..steps.local.len()).filter(|&c| steps.local[c].after_step == Some(j)) {
            local(&mut p, &mut local_done, &packed, c)?;
        }
    }
    if !steps.quantise.is_empty() {
        // After the local chunks on the same stream; the bytes it writes are its own.
        p.ops.push(Op::Quantise);
    }
    if let Some(agreed) = agreed_pending {
        // No step sends fp8 bytes: the rank quantises only what it keeps.
        quantise_agreed(&mut p, agreed);
    }
    let net = p.record(Stream::Net);
    p.wait(Stream::Compute, net);
    let aux = p.record(Stream::Aux);
    p.wait(Stream::Compute, aux);
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::steps::{Buf, Copy, LocalChunk, Message, NetStep, SourceType};
    use crate::Region2d;

    fn two_step_rank() -> RankSteps {
        let k = |src, so, dst, d| Copy::kernel(src, so, dst, d, Region2d::flat(4));
        RankSteps {
            rank: 0,
            world: 2,
            source: SourceType::Bf16,
            copies: vec![
                k(Buf::Source, 0, Buf::Rollout, 0),
                k(Buf::Source, 4, Buf::SendSlot, 0),
                k(Buf::Source, 8, Buf::SendSlot, 0),
                k(Buf::RecvSlot, 0, Buf::Rollout, 4),
                k(Buf::RecvSlot, 0, Buf::Rollout, 8),
            ],
            local: vec![LocalChunk {
                after_step: Some(0),
                gate: Some(1),
                overlap: true,
                ..LocalChunk::upfront(0..1, Stream::Aux)
            }],
            steps: (0..2)
                .map(|j| NetStep {
                    index: j,
                    pack: 1 + j..2 + j,
                    sends: vec![Message {
                        peer: 1,
                        buf: Buf::SendSlot,
                        off: 0,
                        count: 4,
                    }],
                    recvs: vec![Message {
                        peer: 1,
                        buf: Buf::RecvSlot,
                        off: 0,
                        count: 4,
                    }],
                    unpack: 3 + j..4 + j,
                    recv_elems: 4,
                    ..NetStep::default()
                })
                .collect(),
            in_flight: 1,
            send_slot_elems: 4,
            recv_slot_elems: 4,
            source_elems: 12,
            rollout_elems: 12,
            local_elems: 4,
            recv_elems: 8,
            ..RankSteps::default()
        }
    }

    #[test]
    fn one_slot_packs_the_next_step_after_the_network_work() {
        let p = compile(&two_step_rank()).unwrap();
        let ops = p.ops();
        let pos = |want: &Op| ops.iter().position(|o| o == want).unwrap();
        let nccl0 = pos(&Op::Nccl { step: 0, slot: 0 });
        let pack1 = ops
            .iter()
            .position(|o| {
                matches!(
                    o,
                    Op::Copies {
                        role: CopyRole::Pack(1),
                        ..
                    }
                )
            })
            .unwrap();
        // Between them the compute stream waits for step 0's network work.
        let waits = ops[nccl0..pack1].iter().any(|o| {
            matches!(
                o,
                Op::Wait {
                    stream: Stream::Compute,
                    ..
                }
            )
        });
        assert!(nccl0 < pack1 && waits, "{ops:#?}");
        // The local chunk comes after step 0, gated by step 1's pack.
        let local = ops
            .iter()
            .position(|o| {
                matches!(
                    o,
                    Op::Copies {
                        role: CopyRole::Local(0),
                        ..
                    }
                )
            })
            .unwrap();
        assert!(local > pack1);
        assert!(matches!(
            ops[local - 1],
            Op::Wait {
                stream: Stream::Aux,
                ..
            }
        ));
    }

    #[test]
    fn every_wait_names_an_event_recorded_before_it() {
        let p = compile(&two_step_rank()).unwrap();
        let mut recorded = vec![false; p.events()];
        for op in p.ops() {
            match op {
                Op::Record { event, .. } => recorded[*event] = true,
                Op::Wait { event, .. } => assert!(recorded[*event], "{op:?}"),
                _ => {}
            }
        }
    }

    #[test]
    fn a_gate_on_a_pack_not_yet_issued_is_refused() {
        let mut s = two_step_rank();
        s.local[0].after_step = None;
        let err = compile(&s).unwrap_err().to_string();
        assert!(err.contains("issued after it"), "{err}");
    }

    #[test]
    fn copies_outside_their_buffers_are_refused() {
        let mut s = two_step_rank();
        s.copies[3].src_off = 1;
        let err = compile(&s).unwrap_err().to_string();
        assert!(
            err.contains("copy 3") && err.contains("leaves its buffers"),
            "{err}"
        );
        let mut s = two_step_rank();
        s.steps[1].sends[0].peer = 0;
        let err = s.validate().unwrap_err().to_string();
        assert!(err.contains("names this rank"), "{err}");
    }
}
