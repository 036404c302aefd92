//! The GPU side of the one DAPO loop ([`crate::dapo::driver`]): [`GpuDriver`] generates gen
//! batches through the lifecycle's engine ([`GpuGenerate`]) and applies the update through a
//! [`Trainer`] (FSDP: in place on the GPUs; Megatron: through the state download / upload APIs);
//! [`run_policy`] runs one switching policy and prints its lines.

use std::time::Duration;

use lifecycle_core::{
    HumanBytes, HumanDuration, Lifecycle, LifecycleError, Reshard, RolloutSession, Switching,
    TrainSession,
};
use lifecycle_cuda::RolloutBuffer;
use lifecycle_decoder::{ModelConfig, Request, SamplingParams};
use lifecycle_fsdp::FsdpBackend;
use lifecycle_layout::megatron::MegatronLayout;
use lifecycle_layout::{AdamParams, HostTensor};
use lifecycle_megatron::MegatronGpuBackend;

use super::engine::GpuGenerate;
use super::rollout::{prompt, reward, Ctx, Update};
use super::source::Source;
use super::DapoGpuError;
use crate::dapo::megatron::synthetic_hf_grads;
use crate::dapo::{
    run_steps, sample_seed, DapoBackend, GenBatch, GenRequest, Group, LoopEvent, LoopSettings,
    RunReport, StepReport, UpdateOutcome,
};

/// One policy's run and its untimed warm-up.
pub(crate) struct PolicyReport {
    pub(crate) run: RunReport,
    pub(crate) warmup: Duration,
}

impl PolicyReport {
    pub(crate) fn sum(&self, f: impl Fn(&StepReport) -> Duration) -> Duration {
        self.run.steps.iter().map(f).sum()
    }
    pub(crate) fn switches(&self) -> u64 {
        self.run.steps.iter().map(|s| s.switches).sum()
    }
    pub(crate) fn exits(&self) -> u64 {
        self.run.steps.iter().map(|s| s.exits).sum()
    }
    pub(crate) fn bytes(&self) -> u64 {
        self.run.steps.iter().map(|s| s.bytes.moved()).sum()
    }
}

/// The policy's name in the output.
pub(crate) fn name(s: Switching) -> &'static str {
    match s {
        Switching::Lazy => "lazy",
        Switching::Eager => "eager",
    }
}

/// How a GPU backend's training state is updated and reset.
pub(crate) trait Trainer<B: Reshard> {
    /// The update of `step` (synthetic gradients, then Adam).
    fn update<E>(
        &self,
        train: &mut TrainSession<'_, B, E>,
        step: usize,
        kept: &[Group],
    ) -> Result<(), DapoGpuError>;
    /// Back to the initial weights and a fresh optimizer.
    fn reset<E>(&self, train: &mut TrainSession<'_, B, E>) -> Result<(), DapoGpuError>;
    /// What the update is, for the output.
    fn describe(&self) -> String;
}

/// FSDP: synthetic gradients and Adam in place on the GPUs.
pub(crate) struct FsdpTrainer<'a> {
    pub(crate) update: Update,
    pub(crate) source: &'a Source,
}

impl Trainer<FsdpBackend> for FsdpTrainer<'_> {
    fn update<E>(
        &self,
        train: &mut TrainSession<'_, FsdpBackend, E>,
        step: usize,
        _kept: &[Group],
    ) -> Result<(), DapoGpuError> {
        let (backend, state) = train.backend_and_state_mut();
        self.update.apply(backend, state, step)
    }
    fn reset<E>(&self, train: &mut TrainSession<'_, FsdpBackend, E>) -> Result<(), DapoGpuError> {
        let (backend, state) = train.backend_and_state_mut();
        self.source.reset(backend, state)
    }
    fn describe(&self) -> String {
        self.update.describe()
    }
}

/// Where a Megatron run's initial weights come from.
pub(crate) enum MegatronSource {
    /// Made on the GPUs ([`MegatronGpuBackend::synthetic_state`]).
    Synthetic { seed: u64, scale: f32 },
    /// Host tensors ([`MegatronGpuBackend::state_from_hf`]).
    Host { tensors: Vec<HostTensor> },
}

/// Megatron: there is no in-place Adam step on the GPUs for Megatron, so the update downloads
/// the training state ([`MegatronGpuBackend::download_state`]), sets seeded synthetic gradients
/// and runs the CPU executor's distributed-optimizer Adam step, then uploads the state again
/// ([`MegatronGpuBackend::state_from_host`]).
pub(crate) struct MegatronTrainer {
    pub(crate) params: AdamParams,
    pub(crate) grad_scale: f32,
    pub(crate) seed: u64,
    pub(crate) model: ModelConfig,
    pub(crate) layout: MegatronLayout,
    pub(crate) source: MegatronSource,
}

impl MegatronTrainer {
    /// The initial training state on `backend`'s GPUs.
    pub(crate) fn initial(
        &self,
        backend: &MegatronGpuBackend,
    ) -> Result<lifecycle_megatron::MegatronGpuState, DapoGpuError> {
        Ok(match &self.source {
            MegatronSource::Synthetic { seed, scale } => {
                // The synthetic state's m and v are test data (v negative): a fresh optimizer.
                let state = backend.synthetic_state(self.layout.clone(), *seed, *scale)?;
                let mut host = backend.download_state(&state)?;
                host.reset_optimizer()?;
                backend.state_from_host(&host)?
            }
            MegatronSource::Host { tensors } => {
                backend.state_from_hf(self.layout.clone(), tensors.clone())?
            }
        })
    }
}

impl Trainer<MegatronGpuBackend> for MegatronTrainer {
    fn update<E>(
        &self,
        train: &mut TrainSession<'_, MegatronGpuBackend, E>,
        step: usize,
        kept: &[Group],
    ) -> Result<(), DapoGpuError> {
        let (backend, state) = train.backend_and_state_mut();
        let mut host = backend.download_state(state)?;
        let grads = synthetic_hf_grads(&self.model, self.seed, step, kept, self.grad_scale);
        host.set_grads_from_hf(grads)?;
        host.adam_step(self.params)?;
        *state = backend.state_from_host(&host)?;
        Ok(())
    }
    fn reset<E>(
        &self,
        train: &mut TrainSession<'_, MegatronGpuBackend, E>,
    ) -> Result<(), DapoGpuError> {
        let (backend, state) = train.backend_and_state_mut();
        *state = self.initial(backend)?;
        Ok(())
    }
    fn describe(&self) -> String {
        let p = self.params;
        format!(
            "update: synthetic gradients, not a learned update: seeded noise (x {}) as full \
             gradients, then Megatron's distributed-optimizer Adam step (lr {}, betas {} / {}, \
             eps {}) run by the CPU executor on the downloaded state, uploaded again \
             (MegatronGpuBackend::download_state + state_from_host; there is no in-place Adam \
             on the GPUs for Megatron)",
            self.grad_scale, p.lr, p.beta1, p.beta2, p.eps
        )
    }
}

/// The GPU runs' side of the DAPO loop.
pub(crate) struct GpuDriver<'a, T> {
    pub(crate) cx: &'a Ctx<'a>,
    pub(crate) trainer: T,
}

impl<B, E, T> DapoBackend<B, E> for GpuDriver<'_, T>
where
    B: Reshard<Rollout = RolloutBuffer>,
    E: GpuGenerate,
    T: Trainer<B>,
    DapoGpuError: From<LifecycleError<B::Error>>,
{
    type Error = DapoGpuError;

    fn describe(&self) -> Vec<String> {
        vec![self.trainer.describe()]
    }

    fn generate(
        &mut self,
        session: &mut RolloutSession<'_, B, E>,
        request: &GenRequest,
    ) -> Result<GenBatch, DapoGpuError> {
        let cx = self.cx;
        let (r, g) = (&cx.options.run, &cx.options.gpu);
        let prompts: Vec<(Vec<u32>, u32)> = request
            .prompts
            .iter()
            .map(|&id| prompt(id, g.prompt_len, cx.config.model.vocab, cx.modulus))
            .collect();
        // one request per sample, each with its own seed (crate::dapo::sample_seed): the same
        // tokens whatever batch, slot or engine decodes it
        let requests: Vec<Request> = request
            .prompts
            .iter()
            .zip(&prompts)
            .flat_map(|(&id, (p, _))| {
                (0..r.group_size).map(move |s| {
                    let params = SamplingParams::new(r.tokens)
                        .with_temperature(r.temperature)
                        .with_seed(sample_seed(request.seed, id, s));
                    Request::new(p.clone(), params)
                })
            })
            .collect();
        let (weights, mut engine) = session.parts();
        let (out, setup, generate) = engine.run_requests(weights, requests)?;
        let groups = request
            .prompts
            .iter()
            .zip(&prompts)
            .zip(out.chunks(r.group_size))
            .map(|((&id, (_, target)), samples)| Group {
                prompt: id,
                rewards: samples
                    .iter()
                    .map(|s| reward(&s.tokens, *target, cx.modulus))
                    .collect(),
                samples: samples
                    .iter()
                    .map(|s| s.tokens.iter().map(|&t| t as usize).collect())
                    .collect(),
                logprobs: samples.iter().map(|s| s.logprobs.clone()).collect(),
            })
            .collect();
        Ok(GenBatch {
            streamed: None,
            groups,
            setup,
            generate,
        })
    }

    fn update(
        &mut self,
        train: &mut TrainSession<'_, B, E>,
        step: usize,
        kept: &[Group],
    ) -> Result<UpdateOutcome, DapoGpuError> {
        self.trainer.update(train, step, kept)?;
        Ok(UpdateOutcome::Synthetic)
    }

    /// One untimed gen batch of the run's shape (its sequences, prompt length, new tokens and
    /// sampling), so that the first timed call of either policy does not pay for what a first
    /// call of that shape sets up (the engine's KV cache, kernels and cuBLAS choices of those
    /// sizes, the expert paths of that batch): without it, whichever policy ran first paid
    /// ~45 ms more in its first gen batch on a small MoE checkpoint.
    fn warm_up(&mut self, session: &mut RolloutSession<'_, B, E>) -> Result<(), DapoGpuError> {
        let cx = self.cx;
        let (r, g) = (&cx.options.run, &cx.options.gpu);
        let (p, _) = prompt(0, g.prompt_len, cx.config.model.vocab, cx.modulus);
        let requests = (0..(r.prompts_per_batch * r.group_size).max(1))
            .map(|s| {
                let params = SamplingParams::new(r.tokens)
                    .with_temperature(r.temperature)
                    .with_seed(sample_seed(r.seed ^ 0x3A2A_0BB1, 0, s));
                Request::new(p.clone(), params)
            })
            .collect();
        let (weights, mut engine) = session.parts();
        engine.run_requests(weights, requests)?;
        Ok(())
    }
}

/// Runs `--steps` training steps under `switching`; a policy after the first starts again from
/// the initial weights and a fresh optimizer.
pub(crate) fn run_policy<B, E, T>(
    lc: &mut Lifecycle<B, E>,
    driver: &mut GpuDriver<'_, T>,
    switching: Switching,
    first: bool,
) -> Result<PolicyReport, DapoGpuError>
where
    B: Reshard<Rollout = RolloutBuffer>,
    E: GpuGenerate,
    T: Trainer<B>,
    DapoGpuError: From<LifecycleError<B::Error>>,
{
    let cx = driver.cx;
    let r = &cx.options.run;
    let root = cx.root;
    lc.set_switching(switching);
    if !first {
        // Back to the initial weights and a fresh optimizer, so both policies see the same
        // weights at every step.
        let mut tr = lc.train()?;
        driver.trainer.reset(&mut tr)?;
    }
    // Warm-up (not measured): one switch and a one-token generation, so host memory for the
    // offload is pinned and the decoder's kernels, cuBLAS and NCCL are initialised.
    let warmup = crate::dapo::driver::warm_up(lc, driver)?;
    say!(
        root,
        "[{}] warm-up (switch + exit + 1-token generation, not measured): {}",
        name(switching),
        HumanDuration(warmup)
    );
    let settings = LoopSettings {
        steps: r.steps,
        prompts_per_batch: r.prompts_per_batch,
        batch_groups: r.batch_groups,
        max_gen_batches: r.max_gen_batches,
        seed: r.seed,
        streamed: false,
    };
    let run = run_steps(lc, driver, &settings, |e| match e {
        LoopEvent::Batch(b) => say!(
            root,
            "[{}] step {} gen batch {}: {} sequences, {} of {} groups mixed, call {} (switch {} \
             x{}, decoder setup {}, generate {})",
            name(switching),
            b.step,
            b.index,
            b.sequences,
            b.mixed,
            b.groups,
            HumanDuration(b.wall),
            HumanDuration(b.switch),
            b.switches,
            HumanDuration(b.setup),
            HumanDuration(b.generate),
        ),
        LoopEvent::Step(s) => say!(
            root,
            "[{}] step {}: gen batches {}, groups {} generated / {} kept, mean reward {:.3} (kept \
             {:.3}), rollout log-prob per kept token {}, switches {}, exits {}, bytes {} (d2d \
             {}, d2h {}, h2d {}), rollout phase {} (generate {}, decoder setup {}), switch time \
             {}, update {} (of which the update itself {}; the rest is the exit under lazy)",
            name(switching),
            s.step,
            s.gen_batches,
            s.groups,
            s.kept,
            s.mean_reward,
            s.kept_reward,
            s.rollout_logprob
                .map_or("-".to_string(), |lp| format!("{lp:.4}")),
            s.switches,
            s.exits,
            HumanBytes(s.bytes.moved()),
            HumanBytes(s.bytes.device_to_device),
            HumanBytes(s.bytes.device_to_host),
            HumanBytes(s.bytes.host_to_device),
            HumanDuration(s.rollout_time),
            HumanDuration(s.generate),
            HumanDuration(s.setup),
            HumanDuration(s.switch_time),
            HumanDuration(s.update_time),
            HumanDuration(s.update_apply),
        ),
    })?;
    Ok(PolicyReport { run, warmup })
}
