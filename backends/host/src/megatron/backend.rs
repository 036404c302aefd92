//! The CPU executor: runs a [`MegatronPlan`] with ranks as threads.

use crate::per_rank;
use half::bf16;
use lifecycle_core::{Link, MemoryPolicy, Phase, Reshard, SwitchContext};
use lifecycle_layout::{HostRollout, RankRollout, RolloutTensor};

use lifecycle_layout::fp8::{quantize_blocks, RolloutDtype};
use lifecycle_layout::megatron::{
    check_fused_fp8, plan_megatron_to_tp, BucketConfig, MegatronLayoutError, MegatronPlan,
    RankPlan, Transfer,
};
use lifecycle_layout::settings::{Configure, Honours, SwitchOptions};
use lifecycle_layout::RolloutLayout;
use lifecycle_state::megatron::MegatronError;
use lifecycle_state::megatron::{MegatronTrainState, RankTrain};

/// The CPU Megatron backend: ranks are threads of this process, peers' parameter buffers are read
/// through shared memory. Enter copies bf16 runs from the training ranks' parameter buffers into
/// each rank's fused rollout slices, bucket by bucket (remote runs land in a staging buffer of at
/// most the bucket budget first, as received bytes would), then frees grads and offloads as the
/// memory policy says; exit releases the slices, reloads and reallocates zero grads.
///
/// ```
/// use lifecycle_core::Lifecycle;
/// use lifecycle_layout::HostTensor;
/// use lifecycle_layout::megatron::*;
/// use lifecycle_layout::{ModelSpec, RolloutLayout, RolloutVocab};
/// use lifecycle_host::megatron::{MegatronHostBackend, MegatronTrainState};
///
/// let model = ModelSpec::tiny();
/// let tensors = model.hf_tensors().into_iter().map(|(name, shape)| {
///     let n = shape.iter().product();
///     HostTensor::f32(name, shape, (0..n).map(|i| i as f32).collect())
/// }).collect();
/// let state = MegatronTrainState::from_hf(MegatronLayout::new(model, 2, 2, 1)?, tensors)?;
/// let backend = MegatronHostBackend::new(RolloutLayout::fused(4, RolloutVocab::PadToMultipleOf(1)));
/// let mut lc = Lifecycle::new(backend, state);
/// let session = lc.rollout()?;
/// let weights = session.weights();
/// let qkv = weights.ranks[3].tensor("model.layers.1.self_attn.qkv_proj.weight").unwrap();
/// assert_eq!(qkv.shape, vec![(2 + 2) * 2, 16]); // 2 q heads, replicated k and v heads
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct MegatronHostBackend {
    rollout: RolloutLayout,
    config: BucketConfig,
    options: SwitchOptions,
}

impl Configure for MegatronHostBackend {
    const NAME: &'static str = "the Megatron host backend";
    /// Offload overlap changes nothing here (a host offload is a copy in memory, finished
    /// before enter returns); verification is refused.
    const HONOURS: Honours = Honours::OVERLAP_ONLY;

    fn options(&self) -> &SwitchOptions {
        &self.options
    }

    /// Replaces the options. With [`RolloutDtype::Fp8`] every matrix
    /// ([`Fp8Keep::keeps_bf16`](lifecycle_layout::fp8::Fp8Keep::keeps_bf16) false) is quantised
    /// after the transfer to block-scaled e4m3 in the rollout's own 128 × 128 grid, from the bf16
    /// parameters: a fused tensor's blocks and scales are then its parts' stacked, as vLLM's fp8
    /// loader builds them, and bit-identical to the FSDP backends' fp8 rollout of the same
    /// (bf16-exact) weights. A stacked expert tensor (`[e, rows, cols]`) is quantised in its `(e ·
    /// rows) × cols` view: each expert in blocks of its own. `plan` refuses a fused tensor whose
    /// parts would share a block ([`check_fused_fp8`]), naming the tensor, before anything moves.
    ///
    /// ```
    /// use lifecycle_host::megatron::MegatronHostBackend;
    /// use lifecycle_layout::fp8::RolloutDtype;
    /// use lifecycle_layout::settings::Configure;
    /// use lifecycle_layout::{RolloutLayout, RolloutVocab};
    /// let backend = MegatronHostBackend::new(RolloutLayout::fused(2, RolloutVocab::Unpadded))
    ///     .with_rollout_dtype(RolloutDtype::Fp8);
    /// assert_eq!(backend.rollout_dtype(), RolloutDtype::Fp8);
    /// ```
    fn set_options(&mut self, options: SwitchOptions) {
        self.options = options;
    }
}

impl MegatronHostBackend {
    /// A backend producing `rollout`, with default buckets.
    pub fn new(rollout: RolloutLayout) -> Self {
        MegatronHostBackend {
            rollout,
            config: BucketConfig::default(),
            options: SwitchOptions::default(),
        }
    }

    /// Changes the bucket budget (at least 2 bytes: one bf16 element).
    pub fn with_config(mut self, config: BucketConfig) -> Result<Self, MegatronError> {
        if config.bucket_bytes < 2 {
            return Err(MegatronLayoutError::BucketTooSmall {
                bytes: config.bucket_bytes,
            }
            .into());
        }
        self.config = config;
        Ok(self)
    }

    /// The rollout layout.
    pub fn rollout_layout(&self) -> &RolloutLayout {
        &self.rollout
    }

    /// The bucket settings.
    pub fn config(&self) -> BucketConfig {
        self.config
    }
}

impl MegatronHostBackend {
    /// An fp8 rollout: every matrix of every rank quantised in place (its bf16 values given up),
    /// the ranks' memory meters following. Nothing changes on a bf16 rollout.
    fn quantise(
        &self,
        state: &mut MegatronTrainState,
        rollout: &mut HostRollout,
    ) -> Result<(), MegatronError> {
        if self.options.dtype != RolloutDtype::Fp8 {
            return Ok(());
        }
        for (rank, (r, out)) in state
            .ranks_mut()
            .iter_mut()
            .zip(rollout.ranks.iter_mut())
            .enumerate()
        {
            let before = out.bytes();
            // every matrix of the rank quantised first: an error leaves the rank as it was
            let quantised = out
                .tensors
                .iter()
                .map(|t| {
                    if t.fp8.is_some() || self.options.fp8_keep.keeps_bf16(&t.name, &t.shape) {
                        return Ok(None);
                    }
                    // a matrix, or a stack of expert matrices in its (experts · rows) × cols view
                    let cols = t.shape.last().copied().unwrap_or(1);
                    let rows = t.shape[..t.shape.len().saturating_sub(1)].iter().product();
                    let values: Vec<f32> = t.data.iter().map(|v| v.to_f32()).collect();
                    quantize_blocks(&t.name, &values, rows, cols)
                        .map(Some)
                        .map_err(|_| MegatronError::NonFinite {
                            name: t.name.clone(),
                            rank,
                            index: values.iter().position(|v| !v.is_finite()).unwrap_or(0),
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            for (t, q) in out.tensors.iter_mut().zip(quantised) {
                if let Some(q) = q {
                    t.fp8 = Some(q);
                    t.data = Vec::new();
                }
            }
            r.meter.free(before);
            r.meter.alloc(out.bytes());
        }
        Ok(())
    }
}

/// Gives every fp8 slice of `out` back its bf16 room (zeros), for a transfer to rewrite.
fn thaw(out: &mut RankRollout) {
    for t in out.tensors.iter_mut() {
        if t.fp8.take().is_some() {
            t.data = vec![bf16::ZERO; t.shape.iter().product()];
        }
    }
}

/// What one rank's transfer did.
#[derive(Default, Clone, Copy)]
struct Moved {
    remote: u64,
    local: u64,
    staging_peak: u64,
}

/// Copies the rows of transfer `x` from `src` (starting at `src_offset`, rows `src_pitch`
/// apart) to their place in `dst`.
fn copy_run(src: &[bf16], src_offset: usize, src_pitch: usize, dst: &mut [bf16], x: &Transfer) {
    for r in 0..x.rows {
        let (s, d) = (src_offset + r * src_pitch, x.dst_offset + r * x.dst_pitch);
        dst[d..d + x.cols].copy_from_slice(&src[s..s + x.cols]);
    }
}

/// Fills one rank's slices from every rank's parameter buffer, bucket by bucket.
fn fill_rank(params: &[&[bf16]], plan: &RankPlan, out: &mut RankRollout) -> Moved {
    let mut moved = Moved::default();
    let mut staging: Vec<bf16> = Vec::new();
    for bucket in &plan.buckets {
        let xs = &plan.transfers[bucket.clone()];
        // "Receive": remote runs packed into the staging buffer.
        staging.clear();
        for x in xs.iter().filter(|x| x.src_rank != plan.rank) {
            let src = params[x.src_rank];
            for r in 0..x.rows {
                let s = x.src_offset + r * x.src_pitch;
                staging.extend_from_slice(&src[s..s + x.cols]);
            }
        }
        moved.staging_peak = moved.staging_peak.max((staging.len() * 2) as u64);
        // Scatter: local runs from the own buffer, remote runs from staging.
        let mut cursor = 0;
        for x in xs {
            let dst = &mut out.tensors[x.tensor].data;
            if x.src_rank == plan.rank {
                let src = params[x.src_rank];
                copy_run(src, x.src_offset, x.src_pitch, dst, x);
                moved.local += x.bytes();
            } else {
                copy_run(&staging, cursor, x.cols, dst, x);
                cursor += x.numel();
                moved.remote += x.bytes();
            }
        }
    }
    moved
}

fn transfer(
    plan: &MegatronPlan,
    state: &mut MegatronTrainState,
    outs: Vec<&mut RankRollout>,
    ctx: &mut SwitchContext<'_>,
) -> Result<(), MegatronError> {
    let params: Vec<&[bf16]> = state
        .ranks()
        .iter()
        .map(|r| r.params.on_device())
        .collect::<Option<_>>()
        .ok_or(MegatronError::Offloaded {
            operation: "moving weights into the rollout layout",
        })?;
    let moved = ctx.rec.phase(Phase::Transfer, |scope| {
        let moved = per_rank(outs, |rank, out| fill_rank(&params, &plan.ranks[rank], out));
        for m in &moved {
            scope.add_bytes(Link::DeviceToDevice, m.remote);
            scope.add_bytes(Link::Local, m.local);
            scope.note_peak_extra(m.staging_peak);
        }
        Ok::<_, MegatronError>(moved)
    })?;
    for (r, m) in state.ranks_mut().iter_mut().zip(moved) {
        // The staging buffer lived on top of everything else during the transfer.
        r.meter.peak = r.meter.peak.max(r.meter.current + m.staging_peak);
    }
    Ok(())
}

fn offload(state: &mut MegatronTrainState, memory: MemoryPolicy, ctx: &mut SwitchContext<'_>) {
    let _ = ctx.rec.phase(Phase::Offload, |scope| {
        let ranks: Vec<&mut RankTrain> = state.ranks_mut().iter_mut().collect();
        let moved = per_rank(ranks, |_, r| {
            let mut bytes = 0;
            if let Some(g) = r.grads.take() {
                r.meter.free((g.len() * 4) as u64);
            }
            if memory.offload_params {
                bytes += r.params.offload(&mut r.meter);
                bytes += r.main.offload(&mut r.meter);
            }
            if memory.offload_optimizer {
                bytes += r.adam_m.offload(&mut r.meter);
                bytes += r.adam_v.offload(&mut r.meter);
            }
            bytes
        });
        scope.add_bytes(Link::DeviceToHost, moved.iter().sum());
        Ok::<(), MegatronError>(())
    });
}

fn empty_rollout(plan: &MegatronPlan) -> RankRollout {
    RankRollout {
        tensors: plan
            .tensors
            .iter()
            .map(|t| RolloutTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                data: vec![bf16::ZERO; t.numel()],
                fp8: None,
            })
            .collect(),
    }
}

impl Reshard for MegatronHostBackend {
    type TrainState = MegatronTrainState;
    type Rollout = HostRollout;
    type Plan = MegatronPlan;
    type Error = MegatronError;

    fn plan(&self, state: &MegatronTrainState) -> Result<MegatronPlan, MegatronError> {
        self.check_options()?;
        state.layout().check_world(state.world())?;
        let plan = plan_megatron_to_tp(state.layout(), &self.rollout, self.config)?;
        if self.options.dtype == RolloutDtype::Fp8 {
            check_fused_fp8(
                &plan.tensors,
                plan.train.model(),
                self.rollout.tp(),
                self.options.fp8_keep,
            )?;
        }
        Ok(plan)
    }

    fn enter(
        &mut self,
        plan: &MegatronPlan,
        state: &mut MegatronTrainState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<HostRollout, MegatronError> {
        if plan.train != *state.layout() {
            return Err(MegatronError::PlanMismatch);
        }
        if state.is_offloaded() {
            return Err(MegatronError::Offloaded {
                operation: "entering rollout mode",
            });
        }
        let mut rollout = HostRollout {
            ranks: plan.ranks.iter().map(|_| empty_rollout(plan)).collect(),
        };
        for (r, out) in state.ranks_mut().iter_mut().zip(&rollout.ranks) {
            r.meter.alloc(out.bytes());
        }
        let moved = transfer(plan, state, rollout.ranks.iter_mut().collect(), ctx)
            .and_then(|()| self.quantise(state, &mut rollout));
        if let Err(e) = moved {
            for (r, out) in state.ranks_mut().iter_mut().zip(&rollout.ranks) {
                r.meter.free(out.bytes());
            }
            return Err(e);
        }
        offload(state, ctx.memory, ctx);
        Ok(rollout)
    }

    fn refresh(
        &mut self,
        plan: &MegatronPlan,
        state: &mut MegatronTrainState,
        rollout: &mut HostRollout,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), MegatronError> {
        if plan.train != *state.layout() {
            return Err(MegatronError::PlanMismatch);
        }
        if state.is_offloaded() {
            return Err(MegatronError::Offloaded {
                operation: "refreshing rollout weights",
            });
        }
        if rollout.ranks.len() != plan.ranks.len() {
            return Err(MegatronError::RolloutMismatch {
                name: "<rank count>".into(),
                rank: rollout.ranks.len(),
                expected: plan.ranks.len(),
                found: rollout.ranks.len(),
            });
        }
        for rank_plan in &plan.ranks {
            let resident = rollout.ranks.get(rank_plan.rank);
            for (i, spec) in plan.tensors.iter().enumerate() {
                let found = resident
                    .and_then(|r| r.tensors.get(i))
                    .filter(|t| t.name == spec.name)
                    .map_or(0, |t| {
                        t.fp8.as_ref().map_or(t.data.len(), |q| q.rows() * q.cols())
                    });
                if found != spec.numel() {
                    return Err(MegatronError::RolloutMismatch {
                        name: spec.name.clone(),
                        rank: rank_plan.rank,
                        expected: spec.numel(),
                        found,
                    });
                }
            }
        }
        // fp8 slices are rewritten from bf16 ones
        for (r, out) in state.ranks_mut().iter_mut().zip(rollout.ranks.iter_mut()) {
            let before = out.bytes();
            thaw(out);
            r.meter.free(before);
            r.meter.alloc(out.bytes());
        }
        transfer(plan, state, rollout.ranks.iter_mut().collect(), ctx)?;
        self.quantise(state, rollout)?;
        offload(state, ctx.memory, ctx);
        Ok(())
    }

    fn exit(
        &mut self,
        state: &mut MegatronTrainState,
        rollout: Option<HostRollout>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), MegatronError> {
        if let Some(rollout) = rollout {
            ctx.rec.phase(Phase::Release, |_| {
                for (rank, r) in rollout.ranks.into_iter().enumerate() {
                    if let Some(s) = state.ranks_mut().get_mut(rank) {
                        s.meter.free(r.bytes());
                    }
                }
                Ok::<(), MegatronError>(())
            })?;
        }
        ctx.rec.phase(Phase::Reload, |scope| {
            let ranks: Vec<&mut RankTrain> = state.ranks_mut().iter_mut().collect();
            let moved = per_rank(ranks, |_, r| {
                let mut bytes = r.params.reload(&mut r.meter);
                bytes += r.main.reload(&mut r.meter);
                bytes += r.adam_m.reload(&mut r.meter);
                bytes += r.adam_v.reload(&mut r.meter);
                if r.grads.is_none() {
                    let n = r.params.values().len();
                    r.meter.alloc((n * 4) as u64);
                    r.grads = Some(vec![0.0; n]);
                }
                bytes
            });
            scope.add_bytes(Link::HostToDevice, moved.iter().sum());
            Ok(())
        })
    }
}
