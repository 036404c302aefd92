//! The engine under continuous batching: [`EngineSlots`] is a woken [`GpuEngine`] as the
//! [`Scheduler`]'s [`SlotDecoder`] (its fixed KV cache's slots, the device pick with
//! log-probabilities), and [`GpuEngine::run`] serves a list of requests through it.

use lifecycle_core::RolloutView;
use lifecycle_cuda::RolloutBuffer;
use lifecycle_decoder::{KvPaging, PickArgs, Picked, Request, Sample, Scheduler, SlotDecoder};

use crate::decoder::KvMode;
use crate::decoder::RowPick;
use crate::error::GpuDecodeError;
use crate::GpuEngine;

/// A woken [`GpuEngine`] as a [`SlotDecoder`]: made by [`GpuEngine::slots`] from the session's
/// weights view (checked to be those the engine was woken for), so it lives no longer than the
/// session that keeps the weights. Its slots are the engine's `max_sequences`, each of up to
/// `max_tokens` positions in the pages of its KV cache ([`KvPaging`]: the scheduler reserves a
/// request's pages at admission); equal prompts admitted together are prefilled once and share
/// their full pages when [`fork_prefill`](crate::EngineSettings::fork_prefill) is on.
pub struct EngineSlots<'e> {
    engine: &'e mut GpuEngine,
}

impl std::fmt::Debug for EngineSlots<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSlots")
            .field("slots", &self.engine.core.slot_count())
            .field("positions", &self.engine.settings.max_tokens)
            .finish()
    }
}

impl GpuEngine {
    /// The engine as the scheduler's decoder over `weights` (the session's view, checked as
    /// [`GpuEngine::generate`] checks it). Makes the fixed KV cache first where the wake left
    /// it to grow (weights from a switch whose offload still frees memory), each rank's
    /// allocation ordered after the frees that make room for it.
    pub fn slots<'e>(
        &'e mut self,
        weights: &RolloutView<'_, RolloutBuffer>,
    ) -> Result<EngineSlots<'e>, GpuDecodeError> {
        self.check_weights(weights)?;
        if self.core.kv == KvMode::Grow {
            self.alloc_fixed()?;
        }
        Ok(EngineSlots { engine: self })
    }

    /// Serves `requests` on the weights the engine was woken for with continuous batching (see
    /// [`Scheduler`]): every request is checked first (a bad one is refused by name, nothing
    /// runs), then they are admitted in order as slots free up; the samples come back in
    /// request order with their log-probabilities and finish reasons.
    ///
    /// ```no_run
    /// use lifecycle_core::RolloutView;
    /// use lifecycle_cuda::RolloutBuffer;
    /// use lifecycle_decoder::{Request, SamplingParams};
    /// use lifecycle_decoder_gpu::{GpuDecodeError, GpuEngine};
    ///
    /// fn group(engine: &mut GpuEngine, weights: RolloutView<'_, RolloutBuffer>, prompt: Vec<u32>)
    ///     -> Result<(), GpuDecodeError> {
    ///     let requests = (0..16)
    ///         .map(|i| Request::new(prompt.clone(), SamplingParams::new(512)
    ///             .with_temperature(1.0).with_top_p(0.95).with_stop_tokens(vec![151645])
    ///             .with_seed(i)))
    ///         .collect();
    ///     for s in engine.run(weights, requests)? {
    ///         println!("{} tokens, {}, logprobs {:?}", s.tokens.len(), s.finish, &s.logprobs[..1]);
    ///     }
    ///     Ok(())
    /// }
    /// ```
    pub fn run(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        requests: Vec<Request>,
    ) -> Result<Vec<Sample>, GpuDecodeError> {
        let mut slots = self.slots(&weights)?;
        Scheduler::new().run(&mut slots, requests)
    }
}

fn rows(picks: &[PickArgs<'_>]) -> Vec<RowPick> {
    picks.iter().map(RowPick::of).collect()
}

impl SlotDecoder for EngineSlots<'_> {
    type Error = GpuDecodeError;

    fn vocab_size(&self) -> usize {
        self.engine.core.config.model.vocab
    }

    fn slots(&self) -> usize {
        self.engine.core.slot_count()
    }

    fn slot_positions(&self) -> usize {
        self.engine.settings.max_tokens
    }

    fn paging(&self) -> Option<KvPaging> {
        let core = &self.engine.core;
        Some(KvPaging {
            page_positions: crate::KV_PAGE_POSITIONS,
            pages_per_group: core.pages.budget(),
            slots_per_group: core.slots_per_replica(),
        })
    }

    fn map_pages(&mut self, tables: &[(usize, &[u32])]) -> Result<(), GpuDecodeError> {
        self.engine.core.map_pages(tables)
    }

    fn shares_prefixes(&self) -> bool {
        self.engine.settings.fork_prefill
    }

    fn prefill_slots(
        &mut self,
        admitted: &[(usize, &[u32])],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, GpuDecodeError> {
        let e = &mut *self.engine;
        let fork = e.settings.fork_prefill;
        e.core.prefill_slots(&e.pool, admitted, &rows(picks), fork)
    }

    fn decode_slots(
        &mut self,
        rows_in: &[(usize, u32)],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, GpuDecodeError> {
        let e = &mut *self.engine;
        e.core.decode_slots(&e.pool, rows_in, &rows(picks))
    }

    fn mixed_slots(
        &mut self,
        (admitted, admitted_picks): (&[(usize, &[u32])], &[PickArgs<'_>]),
        (fed, fed_picks): (&[(usize, u32)], &[PickArgs<'_>]),
    ) -> Result<(Vec<Picked>, Vec<Picked>), GpuDecodeError> {
        let e = &mut *self.engine;
        let fork = e.settings.fork_prefill;
        let (a, f) = (rows(admitted_picks), rows(fed_picks));
        e.core.mixed_slots(&e.pool, (admitted, &a), (fed, &f), fork)
    }
}
