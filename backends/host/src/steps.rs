//! The CPU executor of step programs: every rank's [`Program`] run over host buffers, with its
//! three streams advanced in a random order that respects the program's events.
//!
//! This is what checks the schedule the GPU engine issues, on any machine: streams of one rank
//! run concurrently, so an operation reads and writes its buffers at the moment the scheduler
//! picks it; a missing wait lets a later operation run first and corrupts (or leaves unwritten)
//! rollout elements, which a comparison with the reference rollout then finds. NCCL groups are
//! posted by their stream and complete when the peers' matching groups are posted (data moves
//! then); all-gathers complete when every rank posted theirs; peer copies write the peer's
//! rollout buffer when they run. Staging slots and rollout buffers start filled with a poison
//! value, so an element read before it was written shows.
//!
//! ```
//! use lifecycle_host::steps::{run_programs, Source};
//! use lifecycle_layout::steps::{compile, Buf, Copy, LocalChunk, RankSteps, SourceType, Stream};
//! use lifecycle_layout::Region2d;
//! let steps = RankSteps {
//!     world: 1,
//!     source: SourceType::F32,
//!     copies: vec![Copy::kernel(Buf::Source, 0, Buf::Rollout, 0, Region2d::flat(2))],
//!     local: vec![LocalChunk::upfront(0..1, Stream::Aux)],
//!     source_elems: 2,
//!     rollout_elems: 2,
//!     ..RankSteps::default()
//! };
//! let program = compile(&steps)?;
//! let out = run_programs(&[(steps, program)], &[Source::F32(&[1.0, -2.5])], 7)?;
//! assert_eq!(out[0], [0x3f80, 0xc020]); // bf16 bits of 1.0 and -2.5
//! # Ok::<(), lifecycle_host::HostError>(())
//! ```

use lifecycle_layout::fp8::{block_scale_inv, e4m3_from_f32, FP8_BLOCK};
use lifecycle_layout::steps::{
    AgreedQuantise, Buf, Copy, GridRegion, NetStep, Op, Program, Quantise, RankSteps, SourceType,
    Stream,
};
use lifecycle_layout::{LayoutError, Region2d};

use crate::HostError;

/// The value unwritten staging and rollout elements hold (a bf16 NaN no cast produces).
pub const POISON: u16 = 0x7fa5;

/// A rank's training buffer.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// fp32 masters.
    F32(&'a [f32]),
    /// bf16 parameters, as bits.
    Bf16(&'a [u16]),
}

impl Source<'_> {
    fn len(&self) -> usize {
        match self {
            Source::F32(s) => s.len(),
            Source::Bf16(s) => s.len(),
        }
    }

    /// Element `i` as f32 (bf16 widened exactly).
    fn value(&self, i: usize) -> f32 {
        match self {
            Source::F32(s) => s[i],
            Source::Bf16(s) => half::bf16::from_bits(s[i]).to_f32(),
        }
    }

    fn bits(&self, i: usize) -> u16 {
        match self {
            Source::F32(s) => half::bf16::from_f32(s[i]).to_bits(),
            Source::Bf16(s) => s[i],
        }
    }
}

struct Rank<'a> {
    steps: &'a RankSteps,
    source: Source<'a>,
    rollout: Vec<u16>,
    send: Vec<Vec<u16>>,
    recv: Vec<Vec<u16>>,
    /// The fp8 scale grid (agreed fp8 switches), NaN until the partial amaxes write it.
    grid: Vec<f32>,
    /// The fp8 stage, as 2-byte elements.
    stage: Vec<u16>,
    queues: [Vec<&'a Op>; 3],
    heads: [usize; 3],
    events: Vec<bool>,
    /// The network stream's head group is posted (waiting for its peers).
    posted: bool,
    /// Peers whose messages of the posted group have moved.
    exchanged: Vec<usize>,
}

fn stream_of(op: &Op) -> Stream {
    match op {
        Op::Zero | Op::Quantise | Op::Amax | Op::QuantiseAgreed => Stream::Aux,
        Op::Copies { stream, .. } | Op::Record { stream, .. } | Op::Wait { stream, .. } => *stream,
        Op::Nccl { .. } | Op::Push { .. } | Op::Agree => Stream::Net,
    }
}

fn idx(s: Stream) -> usize {
    match s {
        Stream::Compute => 0,
        Stream::Aux => 1,
        Stream::Net => 2,
    }
}

/// Elements of a region, in row-major order, as (source, destination) offsets.
fn elements(src: u64, dst: u64, r: &Region2d) -> impl Iterator<Item = (usize, usize)> + '_ {
    (0..r.rows).flat_map(move |i| {
        (0..r.cols).map(move |c| {
            (
                (src + i * r.src_ld + c) as usize,
                (dst + i * r.dst_ld + c) as usize,
            )
        })
    })
}

impl<'a> Rank<'a> {
    fn new(
        steps: &'a RankSteps,
        program: &'a Program,
        source: Source<'a>,
    ) -> Result<Self, HostError> {
        if source.len() as u64 != steps.source_elems {
            return Err(HostError::Layout(LayoutError::InvalidSteps {
                rank: steps.rank,
                what: format!(
                    "the training buffer has {} elements, the steps read {}",
                    source.len(),
                    steps.source_elems
                ),
            }));
        }
        let typed = matches!(
            (source, steps.source),
            (Source::F32(_), SourceType::F32) | (Source::Bf16(_), SourceType::Bf16)
        );
        if !typed {
            return Err(HostError::Layout(LayoutError::InvalidSteps {
                rank: steps.rank,
                what: format!("the steps read a {:?} training buffer", steps.source),
            }));
        }
        let slots = if steps.steps.is_empty() {
            0
        } else {
            steps.in_flight
        };
        let mut queues: [Vec<&Op>; 3] = Default::default();
        for op in program.ops() {
            queues[idx(stream_of(op))].push(op);
        }
        Ok(Rank {
            steps,
            source,
            rollout: vec![POISON; steps.rollout_elems as usize],
            send: vec![vec![POISON; steps.send_slot_elems as usize]; slots],
            recv: vec![vec![POISON; steps.recv_slot_elems as usize]; slots],
            grid: vec![f32::NAN; steps.agree.as_ref().map_or(0, |a| a.grid_elems as usize)],
            stage: vec![POISON; steps.buf_elems(Buf::Fp8Stage) as usize],
            queues,
            heads: [0; 3],
            events: vec![false; program.events()],
            posted: false,
            exchanged: Vec::new(),
        })
    }

    fn head(&self, s: usize) -> Option<&'a Op> {
        self.queues[s].get(self.heads[s]).copied()
    }

    fn read(&self, buf: Buf, slot: usize, i: usize) -> u16 {
        match buf {
            Buf::Source => self.source.bits(i),
            Buf::Rollout => self.rollout[i],
            Buf::SendSlot => self.send[slot][i],
            Buf::RecvSlot => self.recv[slot][i],
            Buf::Fp8Stage => self.stage[i],
            Buf::Scales => (self.grid[i / 2].to_bits() >> (16 * (i % 2))) as u16,
        }
    }

    fn write(&mut self, buf: Buf, slot: usize, i: usize, v: u16) {
        match buf {
            Buf::Rollout => self.rollout[i] = v,
            Buf::SendSlot => self.send[slot][i] = v,
            Buf::RecvSlot => self.recv[slot][i] = v,
            Buf::Fp8Stage => self.stage[i] = v,
            // Validated steps never write the training buffer or the scale grid by copies.
            Buf::Source | Buf::Scales => {}
        }
    }

    fn copy(&mut self, c: &Copy, slot: usize) {
        for (s, d) in elements(c.src_off, c.dst_off, &c.region) {
            let v = self.read(c.src, slot, s);
            self.write(c.dst, slot, d, v);
        }
    }
}

/// Small deterministic generator for the scheduler's choices.
struct Pick(u64);

impl Pick {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

/// One thing the scheduler may do next.
#[derive(Debug, Clone, Copy)]
enum Action {
    /// Run the head operation of stream `s` of rank `r`.
    Run(usize, usize),
    /// Move the messages between the posted groups of ranks `a` and `b`.
    Exchange(usize, usize),
    /// Complete the posted all-gathers (every rank posted its group).
    Gather,
    /// Run the fp8 agreement (every rank's network stream reached it).
    Agree,
}

/// Runs every rank's program (`ranks[r]` for rank `r`, over training buffer `sources[r]`),
/// choosing the next operation among those ready with a generator seeded by `seed`, and returns
/// every rank's rollout buffer as bf16 bits.
///
/// Errors when a rank's buffers do not match its steps, when messages of matching groups
/// disagree in count, or when no operation can run while some remain (a deadlock: a wait whose
/// event is never recorded, or groups whose peers never post theirs).
pub fn run_programs(
    ranks: &[(RankSteps, Program)],
    sources: &[Source<'_>],
    seed: u64,
) -> Result<Vec<Vec<u16>>, HostError> {
    let invalid =
        |rank: usize, what: String| HostError::Layout(LayoutError::InvalidSteps { rank, what });
    if sources.len() != ranks.len() {
        return Err(invalid(
            0,
            format!(
                "{} training buffers for {} ranks",
                sources.len(),
                ranks.len()
            ),
        ));
    }
    let mut rs = Vec::with_capacity(ranks.len());
    for (r, ((steps, program), source)) in ranks.iter().zip(sources).enumerate() {
        if steps.rank != r || steps.world != ranks.len() {
            return Err(invalid(
                r,
                format!(
                    "steps of rank {} of {} given as rank {r} of {}",
                    steps.rank,
                    steps.world,
                    ranks.len()
                ),
            ));
        }
        rs.push(Rank::new(steps, program, *source)?);
    }
    let mut pick = Pick(seed);
    loop {
        let mut actions = Vec::new();
        for (r, rank) in rs.iter().enumerate() {
            for s in 0..3 {
                match rank.head(s) {
                    Some(Op::Wait { event, .. }) if !rank.events[*event] => {}
                    Some(Op::Nccl { .. }) if rank.posted => {}
                    Some(Op::Agree) => {}
                    Some(_) => actions.push(Action::Run(r, s)),
                    None => {}
                }
            }
        }
        fn posted<'a>(r: &Rank<'a>) -> Option<&'a NetStep> {
            match r.head(2) {
                Some(Op::Nccl { step, .. }) if r.posted => Some(&r.steps.steps[*step]),
                _ => None,
            }
        }
        for a in 0..rs.len() {
            let Some(sa) = posted(&rs[a]) else { continue };
            for b in a + 1..rs.len() {
                let Some(sb) = posted(&rs[b]) else { continue };
                let talks = sa.sends.iter().chain(&sa.recvs).any(|m| m.peer == b);
                if sa.index == sb.index && talks && !rs[a].exchanged.contains(&b) {
                    actions.push(Action::Exchange(a, b));
                }
            }
        }
        let gathering = rs
            .iter()
            .filter_map(|r| posted(r))
            .filter(|s| !s.gathers.is_empty())
            .count();
        if gathering == rs.len()
            && rs
                .iter()
                .all(|r| posted(r).is_some_and(|s| peers_done(s, r)))
        {
            actions.push(Action::Gather);
        }
        if rs.iter().all(|r| matches!(r.head(2), Some(Op::Agree))) {
            actions.push(Action::Agree);
        }
        // A posted group with no pending peers and no gathers completes by itself.
        for (r, rank) in rs.iter().enumerate() {
            if let Some(st) = posted(rank)
                && st.gathers.is_empty()
                && peers_done(st, rank)
            {
                actions.push(Action::Run(r, 2));
            }
        }
        if actions.is_empty() {
            if rs.iter().all(|r| (0..3).all(|s| r.head(s).is_none())) {
                return Ok(rs.into_iter().map(|r| r.rollout).collect());
            }
            let stuck: Vec<String> = rs
                .iter()
                .enumerate()
                .flat_map(|(r, rank)| {
                    (0..3).filter_map(move |s| rank.head(s).map(|op| format!("rank {r}: {op:?}")))
                })
                .collect();
            return Err(invalid(
                0,
                format!(
                    "deadlock: no operation can run; heads: {}",
                    stuck.join("; ")
                ),
            ));
        }
        match actions[pick.below(actions.len())] {
            Action::Run(r, s) => step(&mut rs, r, s)?,
            Action::Exchange(a, b) => exchange(&mut rs, a, b)?,
            Action::Agree => agree(&mut rs)?,
            Action::Gather => {
                let Some(Op::Nccl { step, .. }) = rs[0].head(2) else {
                    continue;
                };
                let gathers = rs[0].steps.steps[*step].gathers.clone();
                for g in gathers {
                    for src in 0..rs.len() {
                        let at = (g.off + src as u64 * g.count) as usize;
                        let part: Vec<u16> = rs[src].rollout[at..at + g.count as usize].to_vec();
                        for (d, rank) in rs.iter_mut().enumerate() {
                            if d != src {
                                rank.rollout[at..at + part.len()].copy_from_slice(&part);
                            }
                        }
                    }
                }
                for rank in &mut rs {
                    finish_group(rank);
                }
            }
        }
    }
}

/// Whether every peer of step `st`'s messages exchanged with the rank.
fn peers_done(st: &NetStep, rank: &Rank<'_>) -> bool {
    st.sends
        .iter()
        .chain(&st.recvs)
        .all(|m| rank.exchanged.contains(&m.peer))
}

fn finish_group(rank: &mut Rank<'_>) {
    rank.posted = false;
    rank.exchanged.clear();
    rank.heads[2] += 1;
}

/// Runs the head operation of stream `s` of rank `r` (posting an NCCL group, or completing one
/// whose peers are done).
fn step(rs: &mut [Rank<'_>], r: usize, s: usize) -> Result<(), HostError> {
    let Some(op) = rs[r].head(s) else {
        return Ok(());
    };
    match op {
        Op::Record { event, .. } => rs[r].events[*event] = true,
        Op::Wait { .. } => {}
        Op::Zero => {
            let zero = rs[r].steps.zero.clone();
            for z in zero {
                rs[r].rollout[z.start as usize..z.end as usize].fill(0);
            }
        }
        Op::Quantise => {
            let rank = &mut rs[r];
            for q in &rank.steps.quantise {
                quantise(rank.source, &mut rank.rollout, q);
            }
        }
        Op::Amax => {
            let (master, agree) = agreed_parts(&rs[r])?;
            let rank = &mut rs[r];
            rank.grid.fill(0.0);
            for region in &agree.amax {
                partial_amax(master, &mut rank.grid, region);
            }
        }
        Op::QuantiseAgreed => {
            let (master, agree) = agreed_parts(&rs[r])?;
            let rank = &mut rs[r];
            for q in &agree.quantise {
                quantise_agreed(master, rank, q);
            }
        }
        // A collective: run by the scheduler's `Action::Agree` once every rank reached it.
        Op::Agree => return Ok(()),
        Op::Copies {
            copies, slot, peer, ..
        } => {
            for i in copies.clone() {
                let c = rs[r].steps.copies[i];
                match peer {
                    Some(p) => {
                        for (src, dst) in elements(c.src_off, c.dst_off, &c.region) {
                            let v = rs[r].read(c.src, *slot, src);
                            rs[*p].rollout[dst] = v;
                        }
                    }
                    None => rs[r].copy(&c, *slot),
                }
            }
        }
        Op::Push {
            step,
            runs,
            slot,
            peer,
        } => {
            let steps: &RankSteps = rs[r].steps;
            for run in &steps.steps[*step].pushes[runs.clone()] {
                for (src, dst) in elements(run.src_off, run.dst_off, &run.region) {
                    let v = rs[r].read(run.src, *slot, src);
                    rs[*peer].rollout[dst] = v;
                }
            }
        }
        Op::Nccl { .. } => {
            if rs[r].posted {
                finish_group(&mut rs[r]);
            } else {
                rs[r].posted = true;
            }
            return Ok(());
        }
    }
    rs[r].heads[s] += 1;
    Ok(())
}

/// Byte `at` of a buffer of 2-byte elements (little-endian) set to `v`.
fn set_byte(buf: &mut [u16], at: u64, v: u8) {
    let e = &mut buf[(at / 2) as usize];
    *e = if at.is_multiple_of(2) {
        (*e & 0xff00) | v as u16
    } else {
        (*e & 0x00ff) | ((v as u16) << 8)
    };
}

/// Writes `q`'s e4m3 bytes and block scales into `rollout` (bf16 bits, little-endian bytes), as
/// the GPU kernel does: per 128 × 128 block the amax, `scale_inv = block_scale_inv(amax)`, every
/// value `e4m3(x / scale_inv)`. The regions were validated with the steps.
fn quantise(source: Source<'_>, rollout: &mut [u16], q: &Quantise) {
    let b = FP8_BLOCK as u64;
    let bc = q.cols.div_ceil(b);
    for br in 0..q.rows.div_ceil(b) {
        for bcol in 0..bc {
            let (r0, c0) = (br * b, bcol * b);
            let (r1, c1) = ((r0 + b).min(q.rows), (c0 + b).min(q.cols));
            let at = |r: u64, c: u64| (q.src_off + r * q.src_ld + c) as usize;
            let mut amax = 0.0f32;
            for r in r0..r1 {
                for c in c0..c1 {
                    amax = amax.max(source.value(at(r, c)).abs());
                }
            }
            let s = block_scale_inv(amax);
            for r in r0..r1 {
                for c in c0..c1 {
                    let v = e4m3_from_f32(source.value(at(r, c)) / s);
                    set_byte(rollout, q.dst_byte + r * q.cols + c, v);
                }
            }
            let bits = s.to_bits();
            let k = q.scale + br * bc + bcol;
            rollout[(2 * k) as usize] = bits as u16;
            rollout[(2 * k + 1) as usize] = (bits >> 16) as u16;
        }
    }
}

/// The fp32 training buffer and the agreed fp8 steps of a rank running one of their operations.
fn agreed_parts<'a>(
    rank: &Rank<'a>,
) -> Result<(&'a [f32], &'a lifecycle_layout::steps::Fp8Agree), HostError> {
    let invalid = |what: &str| {
        HostError::Layout(LayoutError::InvalidSteps {
            rank: rank.steps.rank,
            what: what.into(),
        })
    };
    let Source::F32(master) = rank.source else {
        return Err(invalid("an agreed fp8 switch reads a bf16 training buffer"));
    };
    let agree = rank
        .steps
        .agree
        .as_ref()
        .ok_or_else(|| invalid("an fp8 agreement without its steps"))?;
    Ok((master, agree))
}

/// Calls `f(grid index, element index)` for every element of `r` (validated steps).
fn each_in_grid(r: &GridRegion, mut f: impl FnMut(usize, usize)) {
    let b = FP8_BLOCK as u64;
    for i in 0..r.rows {
        let row_blocks = r.grid + (r.row0 + i) / b * r.grid_cols + r.col_block0;
        for c in 0..r.cols {
            f(
                (row_blocks + c / b) as usize,
                (r.src_off + i * r.src_ld + c) as usize,
            );
        }
    }
}

/// The amax of `r`'s values per block, into `grid` (max with what it holds).
fn partial_amax(master: &[f32], grid: &mut [f32], r: &GridRegion) {
    each_in_grid(r, |g, i| grid[g] = grid[g].max(master[i].abs()));
}

/// `q`'s bytes with the agreed scales in the rank's grid, as the GPU kernel writes them.
fn quantise_agreed(master: &[f32], rank: &mut Rank<'_>, q: &AgreedQuantise) {
    let mut k = 0u64;
    let cols = q.region.cols.max(1);
    let grid = &rank.grid;
    let out = match q.dst {
        Buf::Fp8Stage => &mut rank.stage,
        _ => &mut rank.rollout,
    };
    each_in_grid(&q.region, |g, i| {
        let at = q.dst_byte + (k / cols) * q.region.cols + k % cols;
        set_byte(out, at, e4m3_from_f32(master[i] / grid[g]));
        k += 1;
    });
}

/// The agreement: every rank's grid replaced by the elementwise max over the ranks, each entry
/// then its `scale_inv`; every rank's network stream moves past it.
fn agree(rs: &mut [Rank<'_>]) -> Result<(), HostError> {
    let n = rs.first().map_or(0, |r| r.grid.len());
    if let Some(r) = rs.iter().find(|r| r.grid.len() != n) {
        return Err(HostError::Layout(LayoutError::InvalidSteps {
            rank: r.steps.rank,
            what: format!(
                "a scale grid of {} entries, rank 0's has {n}: the ranks' fp8 plans differ",
                r.grid.len()
            ),
        }));
    }
    let agreed: Vec<f32> = (0..n)
        .map(|i| block_scale_inv(rs.iter().fold(0.0f32, |m, r| m.max(r.grid[i]))))
        .collect();
    for r in rs.iter_mut() {
        r.grid.copy_from_slice(&agreed);
        r.heads[2] += 1;
    }
    Ok(())
}

/// Moves the messages between the posted groups of ranks `a` and `b`, both directions.
fn exchange(rs: &mut [Rank<'_>], a: usize, b: usize) -> Result<(), HostError> {
    for (from, to) in [(a, b), (b, a)] {
        let (
            Some(Op::Nccl {
                step: fs,
                slot: fslot,
            }),
            Some(Op::Nccl {
                step: ts,
                slot: tslot,
            }),
        ) = (rs[from].head(2), rs[to].head(2))
        else {
            return Ok(());
        };
        let sends: Vec<_> = rs[from].steps.steps[*fs]
            .sends
            .iter()
            .filter(|m| m.peer == to)
            .copied()
            .collect();
        let recvs: Vec<_> = rs[to].steps.steps[*ts]
            .recvs
            .iter()
            .filter(|m| m.peer == from)
            .copied()
            .collect();
        if sends.len() != recvs.len() || sends.iter().zip(&recvs).any(|(s, r)| s.count != r.count) {
            return Err(HostError::Layout(LayoutError::InvalidSteps {
                rank: from,
                what: format!(
                    "step {}: sends to rank {to} ({:?}) do not match its receives ({:?})",
                    rs[from].steps.steps[*fs].index,
                    sends.iter().map(|m| m.count).collect::<Vec<_>>(),
                    recvs.iter().map(|m| m.count).collect::<Vec<_>>()
                ),
            }));
        }
        let (fslot, tslot) = (*fslot, *tslot);
        for (s, rv) in sends.iter().zip(&recvs) {
            let data: Vec<u16> = (0..s.count as usize)
                .map(|i| rs[from].read(s.buf, fslot, s.off as usize + i))
                .collect();
            for (i, v) in data.into_iter().enumerate() {
                rs[to].write(rv.buf, tslot, rv.off as usize + i, v);
            }
        }
    }
    rs[a].exchanged.push(b);
    rs[b].exchanged.push(a);
    Ok(())
}

/// Every rank's steps compiled, checked and run by [`run_programs`] under `seeds.len()`
/// different interleavings; errors unless every run gives the same rollouts, which are returned.
pub fn run_steps(
    steps: Vec<RankSteps>,
    sources: &[Source<'_>],
    seeds: &[u64],
) -> Result<Vec<Vec<u16>>, HostError> {
    let mut ranks = Vec::with_capacity(steps.len());
    for s in steps {
        let p = lifecycle_layout::steps::compile(&s)?;
        ranks.push((s, p));
    }
    let mut first: Option<Vec<Vec<u16>>> = None;
    for &seed in seeds {
        let out = run_programs(&ranks, sources, seed)?;
        match &first {
            None => first = Some(out),
            Some(f) if *f != out => {
                return Err(HostError::Layout(LayoutError::InvalidSteps {
                    rank: 0,
                    what: format!("the rollouts depend on the interleaving (seed {seed})"),
                }))
            }
            Some(_) => {}
        }
    }
    Ok(first.unwrap_or_default())
}
