use std::time::{Duration, Instant};

use half::bf16;
use lifecycle_core::{Link, MemoryPolicy, Phase, Reshard, SwitchContext};
use lifecycle_layout::{plan_fsdp_to_tp, RankPlan, ReshardPlan, RolloutLayout};

use crate::fp8::{check_fp8_plan, fp8_rollout};
use lifecycle_layout::fp8::{fp8_rank_traffic, Fp8Keep, RolloutDtype};
use lifecycle_layout::lora::Trained;
use lifecycle_layout::settings::{Configure, Honours, SwitchOptions};
use lifecycle_layout::{HostRollout, RankRollout, RolloutTensor};
use lifecycle_state::cast_f32_to_bf16;
use lifecycle_state::HostError;
use lifecycle_state::{checksum_f32, checksum_tensor};
use lifecycle_state::{HostTrainState, RankState};

/// The CPU reference backend: ranks are threads of this process, collectives are shared-memory
/// copies. Enter casts fp32 master shards to bf16 (round to nearest even) straight into each
/// rank's rollout slices, then offloads as the memory policy says; exit releases the slices and
/// reloads.
///
/// ```
/// use lifecycle_core::Lifecycle;
/// use lifecycle_host::{HostBackend, HostTrainState};
/// use lifecycle_layout::{HostTensor, RolloutLayout};
///
/// let state = HostTrainState::from_tensors(2, vec![
///     HostTensor::f32("model.layers.0.mlp.up_proj.weight", [4, 2], (0..8).map(|x| x as f32).collect()),
///     HostTensor::f32("model.norm.weight", [2], vec![1.0, 1.0]),
/// ])?;
/// let layout = RolloutLayout::from_hf_names(2, state.layout().tensors().to_vec())?;
/// let mut lc = Lifecycle::new(HostBackend::new(layout), state);
/// let session = lc.rollout()?;
/// let weights = session.weights();
/// let up = weights.ranks[1].tensor("model.layers.0.mlp.up_proj.weight").unwrap();
/// assert_eq!(up.shape, vec![2, 2]);
/// assert_eq!(up.data[0].to_f32(), 4.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct HostBackend {
    layout: RolloutLayout,
    options: SwitchOptions,
    /// Checksums of the resident rollout slices, per rank and tensor (verification mode).
    rollout_sums: Vec<Vec<u64>>,
    /// With a frozen base: per rank and training tensor, the checksum of a frozen tensor's
    /// master shard when enter cast it (`None` for the trained tensors: the adapters and the
    /// whole tensors beside them).
    frozen_sums: Vec<Vec<Option<u64>>>,
}

impl Configure for HostBackend {
    const NAME: &'static str = "the FSDP host backend";
    /// Offload overlap changes nothing here: a host offload is a copy in memory, finished
    /// before enter returns either way.
    const HONOURS: Honours = Honours::ALL;

    fn options(&self) -> &SwitchOptions {
        &self.options
    }

    /// Replaces the options. An fp8 rollout is quantised in enter and refresh from the fp32
    /// masters as [`fp8_switch`](crate::fp8::fp8_switch) does (the bf16-exempt tensors cast);
    /// verification checksums every offloaded buffer (checked at reload) and the rollout
    /// slices (after each transfer, checked before release).
    ///
    /// ```
    /// use lifecycle_core::Lifecycle;
    /// use lifecycle_host::{HostBackend, HostTrainState};
    /// use lifecycle_layout::fp8::{fp8_rank_traffic, Fp8Keep, RolloutDtype};
    /// use lifecycle_layout::settings::Configure;
    /// use lifecycle_layout::{HostTensor, RolloutLayout};
    ///
    /// let state = HostTrainState::from_tensors(2, vec![
    ///     HostTensor::f32("model.layers.0.mlp.up_proj.weight", [256, 4], vec![0.5; 1024]),
    ///     HostTensor::f32("model.norm.weight", [4], vec![1.0; 4]),
    /// ])?;
    /// let layout = RolloutLayout::from_hf_names(2, state.layout().tensors().to_vec())?;
    /// let backend = HostBackend::new(layout).with_rollout_dtype(RolloutDtype::Fp8);
    /// let mut lc = Lifecycle::new(backend, state);
    /// let session = lc.rollout()?;
    /// let weights = session.weights();
    /// let up = weights.ranks[1].tensor("model.layers.0.mlp.up_proj.weight").unwrap();
    /// let q = up.fp8.as_ref().unwrap(); // 128 rows of e4m3 and one scale
    /// assert_eq!((q.data().len(), q.scale_inv(), up.value(0)), (512, &[0.5 / 448.0][..], 0.5));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn set_options(&mut self, options: SwitchOptions) {
        self.options = options;
        self.rollout_sums.clear();
        self.frozen_sums.clear();
    }
}

impl HostBackend {
    /// A backend producing `layout`.
    pub fn new(layout: RolloutLayout) -> Self {
        HostBackend {
            layout,
            options: SwitchOptions::default(),
            rollout_sums: Vec::new(),
            frozen_sums: Vec::new(),
        }
    }

    /// Each rank's checksum of every frozen tensor's master shard (a frozen base: every tensor
    /// but the trained ones, `trained`).
    fn frozen_sums(state: &HostTrainState, trained: &Trained) -> Vec<Vec<Option<u64>>> {
        let names = state.layout().tensors();
        state
            .ranks()
            .iter()
            .map(|r| {
                r.shards
                    .iter()
                    .zip(names)
                    .map(|(sh, (name, _))| {
                        (!trained.moves(name)).then(|| checksum_f32(sh.master.values()))
                    })
                    .collect()
            })
            .collect()
    }

    /// With a frozen base, refuses a frozen tensor written since enter, by name.
    fn check_frozen(&self, state: &HostTrainState) -> Result<(), HostError> {
        if !self.options.frozen_base {
            return Ok(());
        }
        let now = Self::frozen_sums(state, &self.options.trained);
        let names = state.layout().tensors();
        for (rank, (was, is)) in self.frozen_sums.iter().zip(&now).enumerate() {
            for (i, (a, b)) in was.iter().zip(is).enumerate() {
                if a != b {
                    return Err(HostError::FrozenWritten {
                        name: names[i].0.clone(),
                        rank,
                    });
                }
            }
        }
        Ok(())
    }

    fn record_rollout_sums(&mut self, rollout: &HostRollout) {
        self.rollout_sums = if self.options.verify {
            per_rank(rollout.ranks.iter().collect(), |_, r| {
                r.tensors.iter().map(checksum_tensor).collect()
            })
        } else {
            Vec::new()
        };
    }

    fn check_rollout_sums(&self, rollout: &HostRollout) -> Result<(), HostError> {
        if !self.options.verify || self.rollout_sums.is_empty() {
            return Ok(());
        }
        for (rank, (r, sums)) in rollout.ranks.iter().zip(&self.rollout_sums).enumerate() {
            for (t, &expected) in r.tensors.iter().zip(sums) {
                if checksum_tensor(t) != expected {
                    return Err(HostError::RolloutCorrupted {
                        rank,
                        tensor: t.name.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    /// The rollout layout this backend produces.
    pub fn layout(&self) -> &RolloutLayout {
        &self.layout
    }
}

/// Runs `f(rank, item)` for every item on its own thread (inline when there is one), the way
/// the host backends run their ranks; a panic on a rank thread resumes on the caller.
///
/// ```
/// let squares = lifecycle_host::per_rank(vec![1, 2, 3], |rank, x| (rank, x * x));
/// assert_eq!(squares, vec![(0, 1), (1, 4), (2, 9)]);
/// ```
pub fn per_rank<T: Send, R: Send>(items: Vec<T>, f: impl Fn(usize, T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items
            .into_iter()
            .enumerate()
            .map(|(r, t)| f(r, t))
            .collect();
    }
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(r, t)| scope.spawn(move || f(r, t)))
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    })
}

/// Bytes a rank received from peers and copied locally.
#[derive(Default, Clone, Copy)]
struct Moved {
    remote: u64,
    local: u64,
}

/// Fills one rank's rollout slices from every rank's master shards.
fn fill_rank(
    state: &HostTrainState,
    rank_plan: &RankPlan,
    out: &mut RankRollout,
    only: &(dyn Fn(&str) -> bool + Sync),
) -> Moved {
    let mut moved = Moved::default();
    for (t, dst) in rank_plan.tensors.iter().zip(out.tensors.iter_mut()) {
        if !only(&dst.name) {
            continue;
        }
        let width = state.layout().tensors()[t.train_index]
            .1
            .iter()
            .skip(1)
            .product::<usize>();
        for piece in &t.pieces {
            let shard = &state.ranks()[piece.src_rank].shards[t.train_index];
            let src = shard.master.values();
            for row in piece.rows.clone() {
                let s = (row - shard.rows.start) * width;
                let d = t.dst_offset(row, piece.cols.start);
                let n = piece.cols.len();
                cast_f32_to_bf16(
                    &src[s + piece.cols.start..s + piece.cols.end],
                    &mut dst.data[d..d + n],
                );
            }
            let bytes = (piece.numel() * 2) as u64;
            if piece.src_rank == rank_plan.rank {
                moved.local += bytes;
            } else {
                moved.remote += bytes;
            }
        }
    }
    moved
}

fn empty_rollout(plan: &ReshardPlan, rank_plan: &RankPlan) -> RankRollout {
    RankRollout {
        tensors: rank_plan
            .tensors
            .iter()
            .map(|t| RolloutTensor {
                name: plan.tensors[t.tensor].name.clone(),
                shape: t.shape.clone(),
                data: vec![bf16::ZERO; t.numel()],
                fp8: None,
            })
            .collect(),
    }
}

/// What one rank thread did in a phase, for the trace.
struct RankSpan {
    start: Instant,
    duration: Duration,
    bytes: u64,
    link: Link,
}

/// Runs `f` on every rank's thread, timing each.
fn timed_per_rank<T: Send>(
    items: Vec<T>,
    f: impl Fn(usize, T) -> (u64, Link) + Sync,
) -> Vec<RankSpan> {
    per_rank(items, |rank, item| {
        let start = Instant::now();
        let (bytes, link) = f(rank, item);
        RankSpan {
            start,
            duration: start.elapsed(),
            bytes,
            link,
        }
    })
}

/// Records one span per rank on the rank's `host` track (when tracing).
fn record_rank_spans(ctx: &mut SwitchContext<'_>, phase: Phase, spans: &[RankSpan]) {
    if let Some(trace) = ctx.rec.trace() {
        for (rank, s) in spans.iter().enumerate() {
            trace.record_host(
                phase.name(),
                phase,
                Some(rank),
                "host",
                s.start,
                s.duration,
                s.bytes,
                Some(s.link),
            );
        }
    }
}

fn transfer(
    plan: &ReshardPlan,
    state: &mut HostTrainState,
    outs: Vec<&mut RankRollout>,
    ctx: &mut SwitchContext<'_>,
) -> Result<(), HostError> {
    transfer_some(plan, state, outs, ctx, &|_| true)
}

/// [`transfer`] of the tensors `only` keeps (by name), the others left as they are.
fn transfer_some(
    plan: &ReshardPlan,
    state: &mut HostTrainState,
    outs: Vec<&mut RankRollout>,
    ctx: &mut SwitchContext<'_>,
    only: &(dyn Fn(&str) -> bool + Sync),
) -> Result<(), HostError> {
    let spans = ctx.rec.phase(Phase::Transfer, |scope| {
        let shared: &HostTrainState = state;
        let moved = per_rank(outs, |rank, out| {
            let start = Instant::now();
            let m = fill_rank(shared, &plan.ranks[rank], out, only);
            (m, start, start.elapsed())
        });
        Ok::<_, HostError>(
            moved
                .into_iter()
                .map(|(m, start, duration)| {
                    scope.add_bytes(Link::DeviceToDevice, m.remote);
                    scope.add_bytes(Link::Local, m.local);
                    let link = if m.remote > 0 {
                        Link::DeviceToDevice
                    } else {
                        Link::Local
                    };
                    RankSpan {
                        start,
                        duration,
                        bytes: m.remote + m.local,
                        link,
                    }
                })
                .collect::<Vec<_>>(),
        )
    })?;
    record_rank_spans(ctx, Phase::Transfer, &spans);
    Ok(())
}

/// The fp8 transfer: every rank's slices quantised from the masters ([`fp8_rollout`]), timed as
/// the transfer phase. The bytes are the fp8 plan's ([`fp8_rank_traffic`]): what a rank receives
/// from peers (fp8 rows, scales, amax messages) as device-to-device, the rest of its rollout as
/// local writes.
fn quantise(
    plan: &ReshardPlan,
    state: &HostTrainState,
    keep: Fp8Keep,
    ctx: &mut SwitchContext<'_>,
) -> Result<HostRollout, HostError> {
    let start = Instant::now();
    let traffic = (0..plan.world)
        .map(|r| fp8_rank_traffic(plan, r, keep))
        .collect::<Result<Vec<_>, _>>()?;
    let rollout = ctx.rec.phase(Phase::Transfer, |scope| {
        let rollout = fp8_rollout(state, plan, keep)?;
        for t in &traffic {
            scope.add_bytes(Link::DeviceToDevice, t.recv_bytes + t.amax_bytes);
            scope.add_bytes(Link::Local, t.rollout_bytes.saturating_sub(t.recv_bytes));
        }
        Ok::<_, HostError>(rollout)
    })?;
    let spans: Vec<RankSpan> = traffic
        .iter()
        .map(|t| RankSpan {
            start,
            duration: start.elapsed(),
            bytes: t.rollout_bytes + t.amax_bytes,
            link: if t.recv_bytes > 0 {
                Link::DeviceToDevice
            } else {
                Link::Local
            },
        })
        .collect();
    record_rank_spans(ctx, Phase::Transfer, &spans);
    Ok(rollout)
}

fn offload(
    state: &mut HostTrainState,
    memory: MemoryPolicy,
    verify: bool,
    ctx: &mut SwitchContext<'_>,
) {
    let spans = ctx.rec.phase(Phase::Offload, |scope| {
        let ranks: Vec<&mut RankState> = state.ranks_mut().iter_mut().collect();
        let spans = timed_per_rank(ranks, |_, rank| {
            let mut bytes = 0;
            for shard in &mut rank.shards {
                if let Some(grad) = shard.grad.take() {
                    rank.meter.free((grad.len() * 4) as u64);
                }
                if memory.offload_params {
                    bytes += shard.master.offload(&mut rank.meter, verify);
                }
                if memory.offload_optimizer {
                    bytes += shard.adam_m.offload(&mut rank.meter, verify);
                    bytes += shard.adam_v.offload(&mut rank.meter, verify);
                }
            }
            (bytes, Link::DeviceToHost)
        });
        scope.add_bytes(Link::DeviceToHost, spans.iter().map(|s| s.bytes).sum());
        Ok::<_, HostError>(spans)
    });
    if let Ok(spans) = spans {
        record_rank_spans(ctx, Phase::Offload, &spans);
    }
}

impl Reshard for HostBackend {
    type TrainState = HostTrainState;
    type Rollout = HostRollout;
    type Plan = ReshardPlan;
    type Error = HostError;

    fn plan(&self, state: &HostTrainState) -> Result<ReshardPlan, HostError> {
        let plan = plan_fsdp_to_tp(state.layout(), &self.layout)?;
        self.options
            .trained
            .check(state.layout().tensors().iter().map(|(n, _)| n.as_str()))?;
        if self.options.dtype == RolloutDtype::Fp8 {
            check_fp8_plan(&plan, self.options.fp8_keep)?;
            if self.options.frozen_base {
                let tensors = state.layout().tensors();
                let shapes = tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice()));
                self.options
                    .trained
                    .check_bf16(shapes, self.options.fp8_keep)?;
            }
        }
        if self.options.verify || self.options.dtype == RolloutDtype::Fp8 {
            state.check_finite()?;
        }
        Ok(plan)
    }

    fn enter(
        &mut self,
        plan: &ReshardPlan,
        state: &mut HostTrainState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<HostRollout, HostError> {
        if state.is_offloaded() {
            return Err(HostError::Offloaded {
                operation: "entering rollout mode",
            });
        }
        let rollout = if self.options.dtype == RolloutDtype::Fp8 {
            let rollout = quantise(plan, state, self.options.fp8_keep, ctx)?;
            for (rank, r) in rollout.ranks.iter().enumerate() {
                state.ranks_mut()[rank].meter.alloc(r.bytes());
            }
            rollout
        } else {
            let mut rollout = HostRollout {
                ranks: plan.ranks.iter().map(|r| empty_rollout(plan, r)).collect(),
            };
            for (rank, r) in rollout.ranks.iter().enumerate() {
                state.ranks_mut()[rank].meter.alloc(r.bytes());
            }
            transfer(plan, state, rollout.ranks.iter_mut().collect(), ctx)?;
            rollout
        };
        self.record_rollout_sums(&rollout);
        if self.options.frozen_base {
            self.frozen_sums = Self::frozen_sums(state, &self.options.trained);
        }
        offload(state, ctx.memory, self.options.verify, ctx);
        Ok(rollout)
    }

    fn refresh(
        &mut self,
        plan: &ReshardPlan,
        state: &mut HostTrainState,
        rollout: &mut HostRollout,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), HostError> {
        if state.is_offloaded() {
            return Err(HostError::Offloaded {
                operation: "refreshing rollout weights",
            });
        }
        for (rank_plan, resident) in plan.ranks.iter().zip(&rollout.ranks) {
            for (t, r) in rank_plan.tensors.iter().zip(&resident.tensors) {
                let held = r.fp8.as_ref().map_or(r.data.len(), |q| q.data().len());
                if held != t.numel() || r.name != plan.tensors[t.tensor].name {
                    return Err(HostError::RolloutMismatch {
                        name: plan.tensors[t.tensor].name.clone(),
                        rank: rank_plan.rank,
                        expected: t.numel(),
                        found: held,
                    });
                }
            }
        }
        if self.options.frozen_base && !self.frozen_sums.is_empty() {
            // the base was cast at enter: the trained tensors alone move (bf16 in every rollout
            // dtype)
            self.check_frozen(state)?;
            let trained = &self.options.trained;
            let only = |name: &str| trained.moves(name);
            transfer_some(plan, state, rollout.ranks.iter_mut().collect(), ctx, &only)?;
        } else if self.options.dtype == RolloutDtype::Fp8 {
            *rollout = quantise(plan, state, self.options.fp8_keep, ctx)?;
        } else {
            transfer(plan, state, rollout.ranks.iter_mut().collect(), ctx)?;
        }
        self.record_rollout_sums(rollout);
        if self.options.frozen_base && self.frozen_sums.is_empty() {
            self.frozen_sums = Self::frozen_sums(state, &self.options.trained);
        }
        offload(state, ctx.memory, self.options.verify, ctx);
        Ok(())
    }

    fn exit(
        &mut self,
        state: &mut HostTrainState,
        rollout: Option<HostRollout>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), HostError> {
        let mut rollout_check = Ok(());
        if let Some(rollout) = rollout {
            rollout_check = self.check_rollout_sums(&rollout);
            self.rollout_sums.clear();
            // the base's rollout form goes with it (kept resident, it stays for the refresh)
            self.frozen_sums.clear();
            ctx.rec.phase(Phase::Release, |_| {
                for (rank, r) in rollout.ranks.into_iter().enumerate() {
                    if let Some(s) = state.ranks_mut().get_mut(rank) {
                        s.meter.free(r.bytes());
                    }
                    drop(r);
                }
                Ok::<(), HostError>(())
            })?;
        }
        let names: Vec<String> = state
            .layout()
            .tensors()
            .iter()
            .map(|(n, _)| n.clone())
            .collect();
        let (spans, corrupted) = ctx.rec.phase(Phase::Reload, |scope| {
            let ranks: Vec<&mut RankState> = state.ranks_mut().iter_mut().collect();
            let results = per_rank(ranks, |rank_index, rank| {
                let start = Instant::now();
                let mut bytes = 0;
                let mut corrupted = None;
                for (tensor, shard) in rank.shards.iter_mut().enumerate() {
                    for (buffer, residence) in [
                        ("master", &mut shard.master),
                        ("adam_m", &mut shard.adam_m),
                        ("adam_v", &mut shard.adam_v),
                    ] {
                        match residence.reload(&mut rank.meter) {
                            Ok(b) => bytes += b,
                            Err(m) => {
                                corrupted.get_or_insert(HostError::Corrupted {
                                    rank: rank_index,
                                    tensor: names[tensor].clone(),
                                    buffer,
                                    expected: m.expected,
                                    found: m.found,
                                });
                            }
                        }
                    }
                    if shard.grad.is_none() {
                        let n = shard.master.values().len();
                        rank.meter.alloc((n * 4) as u64);
                        shard.grad = Some(vec![0.0; n]);
                    }
                }
                let span = RankSpan {
                    start,
                    duration: start.elapsed(),
                    bytes,
                    link: Link::HostToDevice,
                };
                (span, corrupted)
            });
            scope.add_bytes(
                Link::HostToDevice,
                results.iter().map(|(s, _)| s.bytes).sum(),
            );
            let (spans, errors): (Vec<RankSpan>, Vec<Option<HostError>>) =
                results.into_iter().unzip();
            Ok::<_, HostError>((spans, errors.into_iter().flatten().next()))
        })?;
        record_rank_spans(ctx, Phase::Reload, &spans);
        if let Some(e) = corrupted {
            return Err(e);
        }
        rollout_check
    }
}
