//! The DAPO loop, written once for every backend: dynamic sampling (gen batches through the
//! session's weights view and the lifecycle's rollout engine until enough groups have mixed
//! rewards), the update in train mode, and what every gen batch and step measured.
//!
//! What differs per backend is a [`DapoBackend`]: how one gen batch is generated (from the
//! [`RolloutSession`]: its weights view and the awake engine), how the update is applied to the
//! training state (from the [`TrainSession`]), and how the run is described. The CPU example
//! (toy policy, checkpoint, Megatron layout) and the GPU programs (FSDP, Megatron) all run
//! [`run_steps`].
//!
//! ```text
//! for step in 1..=steps:
//!     while kept < batch_groups:                       # dynamic sampling
//!         session = lc.rollout()                       # enters only when the weights are stale
//!         batch = backend.generate(&mut session, req)  # weights view + engine
//!         session.finish()                             # eager exits here, lazy keeps the weights
//!         kept += groups of batch with mixed rewards
//!     backend.update(&mut lc.train(), step, kept)      # exits (lazy), bumps the version
//! ```
//!
//! With [`LoopSettings::streamed`] a step's groups come from one streamed fill instead
//! ([`DapoBackend::fill`]: groups submitted as the engine's slots free up, each scored as it
//! finishes, the rest aborted or carried as partial rollouts into the next step).

use std::time::{Duration, Instant};

use lifecycle_core::{
    Lifecycle, LifecycleError, Reshard, RolloutEngine, RolloutSession, TrainSession,
};

use lifecycle_decoder::Filled;

use super::{GenRequest, Group, RunReport, StepReport, UpdateOutcome};

/// The settings of the loop itself (the same on every backend).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoopSettings {
    /// Training steps.
    pub steps: usize,
    /// Prompts per gen batch.
    pub prompts_per_batch: usize,
    /// Groups with mixed rewards a training batch needs.
    pub batch_groups: usize,
    /// Most gen batches per step: when they are spent, the step trains on the groups with mixed
    /// rewards gathered so far (said in its [`StepReport::short_of`]); with none gathered, the
    /// run stops with [`BatchNotFilled`].
    pub max_gen_batches: usize,
    /// Seed of the run: gen batches of step `s` get `seed ^ (s << 32)` ([`GenRequest::seed`]).
    pub seed: u64,
    /// DAPO's dynamic sampling streamed ([`DapoBackend::fill`]: groups submitted as the
    /// engine's slots free up, each scored as it finishes) instead of whole gen batches: one
    /// fill per step, of at most `max_gen_batches × prompts_per_batch` groups (a step that
    /// keeps fewer than `batch_groups` trains on those, one that keeps none is
    /// [`BatchNotFilled`]).
    pub streamed: bool,
}

/// The backend's engine cannot stream dynamic sampling (it holds no KV slots a scheduler could
/// fill); each backend's error type turns it into its own message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamUnsupported {
    /// What the backend runs, and what would stream.
    pub why: String,
}

/// Dynamic sampling found no group with mixed rewards within [`LoopSettings::max_gen_batches`]
/// (nothing to train on); each backend's error type turns it into its own message
/// (`From<BatchNotFilled>`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchNotFilled {
    /// The step (1-based).
    pub step: usize,
    /// Groups kept.
    pub kept: usize,
    /// Groups needed.
    pub needed: usize,
    /// Gen batches run.
    pub gen_batches: usize,
    /// Mean reward of every sample generated in the step.
    pub mean_reward: f32,
}

/// One generated gen batch, with the time its engine spent.
#[derive(Debug, Clone, Default)]
pub struct GenBatch {
    /// The groups, one per prompt of the request, in order.
    pub groups: Vec<Group>,
    /// Per-call engine setup (decoder construction, weight checks); zero for an engine bound
    /// once at wake.
    pub setup: Duration,
    /// Generation alone.
    pub generate: Duration,
    /// A streamed fill ([`DapoBackend::fill`]): what it cost, and the rewards of every group
    /// it scored (sum, samples), kept or not; `None` for a gen batch, whose groups are all
    /// returned.
    pub streamed: Option<(Filled, f64, usize)>,
}

/// What one gen batch (one rollout call) measured.
#[derive(Debug, Clone)]
pub struct BatchReport {
    /// The training step (1-based).
    pub step: usize,
    /// The gen batch within the step (1-based).
    pub index: usize,
    /// Sequences generated (prompts × group size).
    pub sequences: usize,
    /// Groups generated.
    pub groups: usize,
    /// Groups with mixed rewards.
    pub mixed: usize,
    /// The whole rollout call: switch (if any), engine wake, generation, eager exit.
    pub wall: Duration,
    /// Switch time (enter, and the exit under eager) during the call.
    pub switch: Duration,
    /// Switches into rollout mode during the call.
    pub switches: u64,
    /// Per-call engine setup ([`GenBatch::setup`]).
    pub setup: Duration,
    /// Generation alone ([`GenBatch::generate`]).
    pub generate: Duration,
    /// A streamed fill's cost ([`GenBatch::streamed`]).
    pub streamed: Option<Filled>,
}

/// What the loop reports while it runs.
#[derive(Debug, Clone, Copy)]
pub enum LoopEvent<'a> {
    /// A gen batch is done.
    Batch(&'a BatchReport),
    /// A training step (sampling and update) is done.
    Step(&'a StepReport),
}

/// What differs per backend in the DAPO loop: `B` the backend, `E` the rollout engine attached
/// to its lifecycle.
pub trait DapoBackend<B: Reshard, E: RolloutEngine<B::Rollout>> {
    /// The run's error: lifecycle failures, an unfilled batch and a refused stream convert into
    /// it.
    type Error: From<LifecycleError<B::Error>> + From<BatchNotFilled> + From<StreamUnsupported>;

    /// The report's header: what runs (backend, layouts, model, engine, update, reward).
    fn describe(&self) -> Vec<String>;

    /// Generates and rewards one gen batch from the session's weights view and engine
    /// ([`RolloutSession::parts`]); one group per prompt of `request`, in order.
    fn generate(
        &mut self,
        session: &mut RolloutSession<'_, B, E>,
        request: &GenRequest,
    ) -> Result<GenBatch, Self::Error>;

    /// DAPO's dynamic sampling streamed through the session's engine
    /// ([`lifecycle_decoder::GroupStream`]): generates until `want` groups with mixed rewards
    /// are kept, group `g` of the stream being prompt `g`, sampled with `seed`; the kept groups
    /// (all mixed) and [`GenBatch::streamed`]. Backends whose engine holds no KV slots refuse
    /// ([`StreamUnsupported`], the default).
    fn fill(
        &mut self,
        session: &mut RolloutSession<'_, B, E>,
        want: usize,
        seed: u64,
    ) -> Result<GenBatch, Self::Error> {
        let _ = (session, want, seed);
        Err(StreamUnsupported {
            why: format!(
                "{} has no KV slots to stream dynamic sampling through (the CPU decoder's \
                 checkpoint and Megatron runs do: --checkpoint DIR)",
                self.describe()
                    .first()
                    .map_or("this backend", String::as_str)
            ),
        }
        .into())
    }

    /// Applies the update of `step` (1-based) from the kept groups to the training state.
    fn update(
        &mut self,
        train: &mut TrainSession<'_, B, E>,
        step: usize,
        kept: &[Group],
    ) -> Result<UpdateOutcome, Self::Error>;

    /// An untimed warm-up call (kernels, libraries, first-touch memory) before the measured
    /// steps; nothing by default.
    fn warm_up(&mut self, session: &mut RolloutSession<'_, B, E>) -> Result<(), Self::Error> {
        let _ = session;
        Ok(())
    }
}

/// The mean of every rollout log-probability the groups carry; `None` for none.
fn mean_logprob(groups: &[Group]) -> Option<f64> {
    let (sum, n) = groups
        .iter()
        .flat_map(|g| g.logprobs.iter().flatten())
        .fold((0.0f64, 0usize), |(s, n), &x| (s + f64::from(x), n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Ends a rollout call: the body's error first, then the lifecycle's.
fn finish_call<B: Reshard, E: RolloutEngine<B::Rollout>, T, X>(
    session: RolloutSession<'_, B, E>,
    result: Result<T, X>,
) -> Result<T, X>
where
    X: From<LifecycleError<B::Error>>,
{
    let finished = session.finish();
    let value = result?;
    finished?;
    Ok(value)
}

/// Runs the backend's warm-up in one rollout session, then exits; its wall time.
pub fn warm_up<B, E, D>(lc: &mut Lifecycle<B, E>, backend: &mut D) -> Result<Duration, D::Error>
where
    B: Reshard,
    E: RolloutEngine<B::Rollout>,
    D: DapoBackend<B, E>,
{
    let t = Instant::now();
    let mut session = lc.rollout()?;
    let result = backend.warm_up(&mut session);
    let exited = session.exit();
    result?;
    exited?;
    Ok(t.elapsed())
}

/// The DAPO loop on `lc` under its current switching policy: per step, gen batches (prompt ids
/// counting up from 0 over the run) until `batch_groups` groups with mixed rewards are kept,
/// then the update. `on` sees every gen batch and step. The report's metrics are those of this
/// run (the lifecycle's metrics since the call began).
pub fn run_steps<B, E, D>(
    lc: &mut Lifecycle<B, E>,
    backend: &mut D,
    settings: &LoopSettings,
    mut on: impl FnMut(LoopEvent<'_>),
) -> Result<RunReport, D::Error>
where
    B: Reshard,
    E: RolloutEngine<B::Rollout>,
    D: DapoBackend<B, E>,
{
    let s = settings;
    let start = Instant::now();
    let at_start = lc.metrics().clone();
    let mut next_prompt = 0u64;
    let mut steps = Vec::new();
    let mut all_groups = Vec::new();
    for step in 1..=s.steps {
        let before = lc.metrics().clone();
        let mut kept: Vec<Group> = Vec::new();
        let (mut gen_batches, mut generated) = (0, 0);
        let (mut reward_sum, mut samples) = (0.0f64, 0usize);
        let (mut generate, mut setup) = (Duration::ZERO, Duration::ZERO);
        let mut batch_switch = Vec::new();
        let mut streamed = None;
        let rollout_start = Instant::now();
        while kept.len() < s.batch_groups {
            if gen_batches == s.max_gen_batches && !kept.is_empty() {
                // The gen batches are spent: train on the groups gathered (said in the report).
                break;
            }
            if gen_batches == s.max_gen_batches {
                return Err(BatchNotFilled {
                    step,
                    kept: kept.len(),
                    needed: s.batch_groups,
                    gen_batches,
                    mean_reward: (reward_sum / samples.max(1) as f64) as f32,
                }
                .into());
            }
            let request = GenRequest {
                step,
                batch: gen_batches,
                prompts: (next_prompt..next_prompt + s.prompts_per_batch as u64).collect(),
                seed: s.seed ^ ((step as u64) << 32),
            };
            next_prompt += s.prompts_per_batch as u64;
            let call_before = lc.metrics().clone();
            let call_start = Instant::now();
            let batch = {
                let mut session = lc.rollout()?;
                let result = if s.streamed {
                    backend.fill(&mut session, s.batch_groups - kept.len(), s.seed)
                } else {
                    backend.generate(&mut session, &request)
                };
                finish_call(session, result)?
            };
            let wall = call_start.elapsed();
            let call = lc.metrics().since(&call_before);
            gen_batches += 1;
            generate += batch.generate;
            setup += batch.setup;
            batch_switch.push(call.switch_time());
            let (sequences, groups) = match &batch.streamed {
                Some((filled, rewards, scored)) => {
                    reward_sum += rewards;
                    samples += scored;
                    (filled.finished, filled.kept.len() + filled.dropped_groups)
                }
                None => {
                    for g in &batch.groups {
                        reward_sum += g.rewards.iter().map(|&r| f64::from(r)).sum::<f64>();
                        samples += g.rewards.len();
                    }
                    let sequences = batch.groups.iter().map(|g| g.samples.len()).sum();
                    (sequences, batch.groups.len())
                }
            };
            generated += groups;
            let report = BatchReport {
                step,
                index: gen_batches,
                sequences,
                groups,
                mixed: batch.groups.iter().filter(|g| !g.uniform()).count(),
                wall,
                switch: call.switch_time(),
                switches: call.switches(),
                setup: batch.setup,
                generate: batch.generate,
                streamed: batch.streamed.as_ref().map(|s| s.0.clone()),
            };
            on(LoopEvent::Batch(&report));
            streamed = report.streamed.clone();
            all_groups.extend(batch.groups.iter().cloned());
            kept.extend(batch.groups.into_iter().filter(|g| !g.uniform()));
            if s.streamed {
                // one fill per step, bounded by the step's groups (max_gen_batches × prompts):
                // what it kept, or nothing to train on
                if kept.is_empty() {
                    return Err(BatchNotFilled {
                        step,
                        kept: 0,
                        needed: s.batch_groups,
                        gen_batches,
                        mean_reward: (reward_sum / samples.max(1) as f64) as f32,
                    }
                    .into());
                }
                break;
            }
        }
        let rollout_time = rollout_start.elapsed();
        kept.truncate(s.batch_groups);
        let short_of = (kept.len() < s.batch_groups).then_some(s.batch_groups);
        let mean_reward = (reward_sum / samples.max(1) as f64) as f32;
        let kept_reward = kept.iter().flat_map(|g| &g.rewards).sum::<f32>()
            / kept.iter().map(|g| g.rewards.len()).sum::<usize>().max(1) as f32;
        let rollout_logprob = mean_logprob(&kept);

        let update_start = Instant::now();
        let (outcome, update_apply) = {
            let mut train = lc.train()?;
            let t = Instant::now();
            let outcome = backend.update(&mut train, step, &kept)?;
            (outcome, t.elapsed())
        };
        let update_time = update_start.elapsed();
        let delta = lc.metrics().since(&before);
        let report = StepReport {
            step,
            gen_batches,
            groups: generated,
            kept: kept.len(),
            short_of,
            mean_reward,
            kept_reward,
            rollout_logprob,
            switches: delta.switches(),
            exits: delta.exits,
            bytes: delta.bytes(),
            rollout_time,
            switch_time: delta.switch_time(),
            update_time,
            update_apply,
            generate,
            setup,
            batch_switch,
            update: outcome,
            streamed,
        };
        on(LoopEvent::Step(&report));
        steps.push(report);
    }
    Ok(RunReport {
        switching: lc.config().switching,
        steps,
        metrics: lc.metrics().since(&at_start),
        total_time: start.elapsed(),
        groups: all_groups,
        trace: lc.trace().clone(),
    })
}
