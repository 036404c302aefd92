//! The training steps of one switching policy: dynamic sampling until the batch is full, then
//! the in-place update; what each step measured.

use std::time::{Duration, Instant};

use lifecycle_core::{HumanBytes, HumanDuration, Lifecycle, LinkBytes, Metrics, Switching};
use lifecycle_decoder::{Decoder, Sampling};
use lifecycle_fsdp::FsdpBackend;

use super::rollout::{rollout_batch, Ctx, Group};
use super::source::Source;
use super::DapoGpuError;
use lifecycle_decoder_gpu::GpuDecoder;

/// What one training step measured.
pub(crate) struct StepReport {
    pub(crate) gen_batches: usize,
    pub(crate) kept_groups: usize,
    pub(crate) generated_groups: usize,
    pub(crate) mean_reward: f32,
    pub(crate) switches: u64,
    pub(crate) exits: u64,
    pub(crate) bytes: LinkBytes,
    pub(crate) rollout: Duration,
    pub(crate) generate: Duration,
    pub(crate) setup: Duration,
    pub(crate) switch: Duration,
    /// The update phase: `lc.train()` (lazy's exit) and the in-place step.
    pub(crate) update: Duration,
    /// The in-place step alone (synthetic gradients + Adam).
    pub(crate) adam: Duration,
    /// Switch time of each gen batch's rollout call.
    pub(crate) batch_switch: Vec<Duration>,
}

/// What one policy's run measured, and every group it generated.
pub(crate) struct PolicyReport {
    pub(crate) switching: Switching,
    pub(crate) steps: Vec<StepReport>,
    pub(crate) groups: Vec<Group>,
    pub(crate) warmup: Duration,
}

impl PolicyReport {
    pub(crate) fn sum(&self, f: impl Fn(&StepReport) -> Duration) -> Duration {
        self.steps.iter().map(f).sum()
    }
    pub(crate) fn switches(&self) -> u64 {
        self.steps.iter().map(|s| s.switches).sum()
    }
    pub(crate) fn exits(&self) -> u64 {
        self.steps.iter().map(|s| s.exits).sum()
    }
    pub(crate) fn bytes(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes.moved()).sum()
    }
}

/// The policy's name in the output.
pub(crate) fn name(s: Switching) -> &'static str {
    match s {
        Switching::Lazy => "lazy",
        Switching::Eager => "eager",
    }
}

/// Runs `--steps` training steps under `switching`; a policy after the first starts again from
/// the initial weights and a fresh optimizer.
pub(crate) fn run_policy(
    lc: &mut Lifecycle<FsdpBackend>,
    cx: &Ctx<'_>,
    source: &Source,
    switching: Switching,
    first: bool,
) -> Result<PolicyReport, DapoGpuError> {
    let r = &cx.options.run;
    let root = cx.root;
    lc.set_switching(switching);
    if !first {
        // Back to the initial weights and a fresh optimizer, in place, so both policies see the
        // same weights at every step.
        let mut tr = lc.train()?;
        let (backend, state) = tr.backend_and_state_mut();
        source.reset(backend, state)?;
    }
    // Warm-up (not measured): one switch and a one-token generation, so host memory for the
    // offload is pinned (the first policy only: the buffers are kept) and the decoder's kernels,
    // cuBLAS and NCCL are initialised.
    let t = Instant::now();
    {
        let session = lc.rollout()?;
        {
            let w = session.weights();
            let mut decoder = GpuDecoder::new(cx.config, session.backend(), w.get())?;
            decoder.generate(&[vec![1, 2, 3]], &Sampling::greedy(1))?;
        }
        session.exit()?;
    }
    let warmup = t.elapsed();
    say!(
        root,
        "[{}] warm-up (switch + exit + 1-token generation, not measured): {}",
        name(switching),
        HumanDuration(warmup)
    );
    let mut next_prompt = 0u64;
    let mut steps = Vec::new();
    let mut all_groups = Vec::new();
    for step in 1..=r.steps {
        let before = lc.metrics().clone();
        let start = Instant::now();
        let mut kept: Vec<Group> = Vec::new();
        let (mut gen_batches, mut generated) = (0usize, 0usize);
        let (mut generate, mut setup) = (Duration::ZERO, Duration::ZERO);
        let mut batch_switch = Vec::new();
        while kept.len() < r.batch_groups {
            if gen_batches == r.max_gen_batches {
                return Err(DapoGpuError::BatchNotFilled {
                    step,
                    kept: kept.len(),
                    needed: r.batch_groups,
                    gen_batches,
                });
            }
            let ids: Vec<u64> = (next_prompt..next_prompt + r.prompts_per_batch as u64).collect();
            next_prompt += r.prompts_per_batch as u64;
            let seed = r.seed ^ ((step as u64) << 32) ^ ((gen_batches as u64) << 16);
            let b = rollout_batch(lc, cx, &ids, seed)?;
            gen_batches += 1;
            generated += b.groups.len();
            generate += b.generate;
            setup += b.setup;
            batch_switch.push(b.switch);
            let n_kept = b.groups.iter().filter(|g| !g.uniform()).count();
            say!(
                root,
                "[{}] step {step} gen batch {gen_batches}: {} sequences, {n_kept} of {} groups \
                 mixed, call {} (switch {} x{}, decoder setup {}, generate {})",
                name(switching),
                ids.len() * r.group_size,
                b.groups.len(),
                HumanDuration(b.wall),
                HumanDuration(b.switch),
                b.switches,
                HumanDuration(b.setup),
                HumanDuration(b.generate),
            );
            all_groups.extend(b.groups.iter().cloned());
            kept.extend(b.groups.into_iter().filter(|g| !g.uniform()));
        }
        let rollout = start.elapsed();
        kept.truncate(r.batch_groups);
        let mean_reward = kept.iter().flat_map(|g| &g.rewards).sum::<f32>()
            / (kept.len() * r.group_size).max(1) as f32;
        let t = Instant::now();
        let adam = {
            let mut tr = lc.train()?;
            let (backend, state) = tr.backend_and_state_mut();
            let t = Instant::now();
            cx.update.apply(backend, state, step)?;
            t.elapsed()
        };
        let update = t.elapsed();
        let delta: Metrics = lc.metrics().since(&before);
        let s = StepReport {
            gen_batches,
            kept_groups: kept.len(),
            generated_groups: generated,
            mean_reward,
            switches: delta.switches(),
            exits: delta.exits,
            bytes: delta.bytes(),
            rollout,
            generate,
            setup,
            switch: delta.switch_time(),
            update,
            adam,
            batch_switch,
        };
        say!(
            root,
            "[{}] step {step}: gen batches {}, groups {} generated / {} kept, mean reward {:.3}, \
             switches {}, exits {}, bytes {} (d2d {}, d2h {}, h2d {}), rollout phase {} (generate \
             {}, decoder setup {}), switch time {}, update {} (of which Adam step on synthetic \
             gradients {}; the rest is the exit under lazy)",
            name(switching),
            s.gen_batches,
            s.generated_groups,
            s.kept_groups,
            s.mean_reward,
            s.switches,
            s.exits,
            HumanBytes(s.bytes.moved()),
            HumanBytes(s.bytes.device_to_device),
            HumanBytes(s.bytes.device_to_host),
            HumanBytes(s.bytes.host_to_device),
            HumanDuration(s.rollout),
            HumanDuration(s.generate),
            HumanDuration(s.setup),
            HumanDuration(s.switch),
            HumanDuration(s.update),
            HumanDuration(s.adam),
        );
        steps.push(s);
    }
    Ok(PolicyReport {
        switching,
        steps,
        groups: all_groups,
        warmup,
    })
}
