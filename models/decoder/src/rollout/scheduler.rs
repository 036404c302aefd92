//! Continuous batching: requests queue, each running request holds one KV slot of the decoder,
//! a finished request frees its slot at once and the next queued request takes it at the next
//! step ([`Scheduler`]); what a decoder does for it is [`SlotDecoder`].
//!
//! The policy when KV runs out is to reserve at admission: a request is refused at
//! [`Scheduler::submit`] when its prompt and every token it may sample do not fit one slot (or,
//! on a paged decoder, the pages of one group), and is admitted only into a free slot that holds
//! all of it: with [paging](SlotDecoder::paging), only when the pages for all of it are free
//! ([`KvPages`], which also says how a group's samples share their prompt's pages). So no step
//! ever runs out of room, and nothing is preempted for room.
//!
//! The scheduler is deterministic: requests are admitted in submission order into the lowest
//! free slot, prefilled together between decode steps, and every step feeds the running
//! requests in slot order. A request draws from its own generator (one uniform per sampled
//! token, [`SamplingParams::seed`]), so its draws never depend on the other requests. Its
//! tokens then depend on them only through the logits: on the CPU decoder a row's logits do not
//! depend on the other rows of a step (each row is computed alone), so its tokens are bitwise
//! the same whatever shares its steps; on a GPU, matrix products over more or fewer rows may
//! round differently, so a request's tokens are the same given equal logits.

use std::collections::VecDeque;

use crate::error::DecodeError;
use crate::rollout::pages::{KvPages, KvPaging};
use crate::rollout::pick::Picked;
use crate::rollout::request::{FinishReason, Request, Sample, SamplingParams};
use crate::sampling::SplitMix64;

/// How one row of a step picks its token: its request's settings and its draw.
#[derive(Debug, Clone, Copy)]
pub struct PickArgs<'a> {
    /// The request's sampling settings.
    pub params: &'a SamplingParams,
    /// The request's next uniform draw in [0, 1) (0 when greedy: no draw is taken).
    pub uniform: f32,
}

/// What a decoder does for the [`Scheduler`]: prefill prompts into KV slots and feed one token
/// to running slots, picking each row's next token as [`pick`](crate::pick) says.
pub trait SlotDecoder {
    /// Why a call failed (a request error converts into it).
    type Error: From<DecodeError>;

    /// Vocabulary size.
    fn vocab_size(&self) -> usize;

    /// Sequences the KV cache holds at once.
    fn slots(&self) -> usize;

    /// Positions one slot holds (the most one request may hold).
    fn slot_positions(&self) -> usize;

    /// How the KV cache is paged, where it is: the scheduler then reserves each request's pages
    /// at admission ([`KvPages`]) and maps them ([`SlotDecoder::map_pages`]) before the prefill
    /// that admits it. `None` (the default): every slot holds
    /// [`slot_positions`](SlotDecoder::slot_positions) positions of its own.
    fn paging(&self) -> Option<KvPaging> {
        None
    }

    /// Maps each `(slot, pages)` of `tables` (the pages of [`SlotDecoder::paging`]'s groups the
    /// slot holds, in order of its positions) before the prefill that admits the slot's request.
    fn map_pages(&mut self, tables: &[(usize, &[u32])]) -> Result<(), Self::Error> {
        let _ = tables;
        Ok(())
    }

    /// Whether requests with equal contexts admitted in one prefill are run through the model
    /// once and their KV shared (a group's samples, the first of them the leader): the
    /// scheduler then lets them share their full pages.
    fn shares_prefixes(&self) -> bool {
        false
    }

    /// Prefills each `(slot, prompt)` into its slot (whatever the slot held before is dropped)
    /// and picks each one's first token; `picks[i]` is row `i`'s.
    fn prefill_slots(
        &mut self,
        admitted: &[(usize, &[u32])],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, Self::Error>;

    /// Appends token `t` to slot `s` for each `(s, t)` of `rows` (at the slot's length) and
    /// picks each row's next token.
    fn decode_slots(
        &mut self,
        rows: &[(usize, u32)],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, Self::Error>;

    /// One step that feeds `rows` (as [`SlotDecoder::decode_slots`]: every slot holding a
    /// running request but the admitted ones) and prefills `admitted` into free slots (as
    /// [`SlotDecoder::prefill_slots`]): the picks of the admitted, then of the rows. A decoder
    /// that can run both in one pass over the weights overrides it; by default the two calls in
    /// turn (the rows first, while the admitted slots are still free).
    fn mixed_slots(
        &mut self,
        (admitted, admitted_picks): (&[(usize, &[u32])], &[PickArgs<'_>]),
        (rows, row_picks): (&[(usize, u32)], &[PickArgs<'_>]),
    ) -> Result<(Vec<Picked>, Vec<Picked>), Self::Error> {
        let fed = if rows.is_empty() {
            Vec::new()
        } else {
            self.decode_slots(rows, row_picks)?
        };
        let first = if admitted.is_empty() {
            Vec::new()
        } else {
            self.prefill_slots(admitted, admitted_picks)?
        };
        Ok((first, fed))
    }
}

/// A request that holds a slot.
#[derive(Debug, Clone)]
struct Running {
    request: Request,
    rng: SplitMix64,
    sample: Sample,
}

impl Running {
    fn new(id: u64, request: Request) -> Self {
        let rng = SplitMix64::from_keys(&[request.params.seed]);
        Running {
            rng,
            sample: Sample {
                id,
                tokens: Vec::new(),
                logprobs: Vec::new(),
                raw_logprobs: Vec::new(),
                truncated_logprobs: Vec::new(),
                versions: Vec::new(),
                finish: FinishReason::Length,
            },
            request,
        }
    }

    /// What a prefill runs through the model: the prompt and every token sampled so far (a
    /// preempted request's are prefilled again).
    fn context(&self) -> Vec<u32> {
        let mut c = self.request.prompt.clone();
        c.extend_from_slice(&self.sample.tokens);
        c
    }

    fn draw(&mut self) -> f32 {
        if self.request.params.greedy() {
            0.0
        } else {
            self.rng.next_f32()
        }
    }

    /// Appends a token picked on weights of `version`; whether the sample is finished (and
    /// why).
    fn push(&mut self, p: Picked, version: u64) -> Option<FinishReason> {
        let s = &mut self.sample;
        s.tokens.push(p.token);
        s.versions.push(version);
        s.logprobs.push(p.logprob);
        s.raw_logprobs.push(p.raw_logprob);
        s.truncated_logprobs.push(p.truncated_logprob);
        if self.request.params.stops_at(p.token) {
            Some(FinishReason::Stop)
        } else if s.tokens.len() >= self.request.params.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    fn finish(mut self, why: FinishReason) -> Sample {
        self.sample.finish = why;
        self.sample
    }

    fn last(&self) -> u32 {
        self.sample.tokens.last().copied().unwrap_or(0)
    }
}

/// The continuous-batching scheduler of [the module](self): a queue of requests and the KV
/// slots of one decoder.
///
/// ```
/// use lifecycle_decoder::{FinishReason, Request, SamplingParams, Scheduler};
/// # use lifecycle_decoder::{PickArgs, Picked, SlotDecoder, DecodeError};
/// # /// A decoder whose next token is always the previous one + 1.
/// # struct Count { slots: usize }
/// # impl SlotDecoder for Count {
/// #     type Error = DecodeError;
/// #     fn vocab_size(&self) -> usize { 100 }
/// #     fn slots(&self) -> usize { self.slots }
/// #     fn slot_positions(&self) -> usize { 16 }
/// #     fn prefill_slots(&mut self, a: &[(usize, &[u32])], _: &[PickArgs<'_>]) -> Result<Vec<Picked>, DecodeError> {
/// #         Ok(a.iter().map(|(_, p)| one(p[p.len() - 1] + 1)).collect())
/// #     }
/// #     fn decode_slots(&mut self, r: &[(usize, u32)], _: &[PickArgs<'_>]) -> Result<Vec<Picked>, DecodeError> {
/// #         Ok(r.iter().map(|&(_, t)| one(t + 1)).collect())
/// #     }
/// # }
/// # fn one(token: u32) -> Picked { Picked { token, logprob: 0.0, raw_logprob: 0.0, truncated_logprob: 0.0 } }
/// let mut decoder = Count { slots: 2 };
/// let mut s = Scheduler::new();
/// let stop_at_5 = SamplingParams::new(8).with_stop_tokens(vec![5]);
/// let requests = vec![
///     Request::new(vec![1], stop_at_5.clone()),     // 2 3 4 5: stops
///     Request::new(vec![1], SamplingParams::new(2)), // 2 3: its length
///     Request::new(vec![3], stop_at_5),              // waits for a free slot: 4 5
/// ];
/// let samples = s.run(&mut decoder, requests)?;
/// assert_eq!(samples[0].tokens, vec![2, 3, 4, 5]);
/// assert_eq!(samples[1].finish, FinishReason::Length);
/// assert_eq!((samples[2].tokens.clone(), samples[2].finish), (vec![4, 5], FinishReason::Stop));
/// # Ok::<(), DecodeError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Scheduler {
    queue: VecDeque<Running>,
    running: Vec<Option<Running>>,
    next_id: u64,
    /// The weight version tokens are sampled on from now on.
    version: u64,
    /// The pages running requests hold, on a paged decoder.
    pages: Option<KvPages>,
    /// Steps run and rows fed, since the scheduler was made.
    steps: u64,
    rows: u64,
    /// Admitted requests are prefilled in the pass that feeds the running ones
    /// ([`Scheduler::with_mixed_steps`]).
    mixed: bool,
}

impl Scheduler {
    /// An empty scheduler (it takes the decoder's slot count at its first step).
    pub fn new() -> Self {
        Self::default()
    }

    /// Prefills admitted requests in the same pass as the running requests' next tokens
    /// ([`SlotDecoder::mixed_slots`]: one pass over the weights where the decoder can) instead
    /// of in a pass of their own before it (the default). An admitted request then gets its
    /// first token in the step it is admitted and its second in the next (instead of both in
    /// one step): its tokens are the same given equal logits, and the steps fewer.
    pub fn with_mixed_steps(mut self, on: bool) -> Self {
        self.mixed = on;
        self
    }

    /// Queues `request` for `decoder` after checking it (its fields, its tokens, and that it
    /// fits one KV slot: the reserve-at-admission policy); its id, in submission order.
    pub fn submit<D: SlotDecoder>(
        &mut self,
        decoder: &D,
        request: Request,
    ) -> Result<u64, DecodeError> {
        request.check(decoder.vocab_size())?;
        check_room(decoder, &request)?;
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push_back(Running::new(id, request));
        Ok(id)
    }

    /// Requests queued and not yet admitted.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Requests holding a slot.
    pub fn running(&self) -> usize {
        self.running.iter().flatten().count()
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running() == 0
    }

    /// Steps run and rows they fed (prefill rows not counted) since the scheduler was made.
    pub fn counts(&self) -> (u64, u64) {
        (self.steps, self.rows)
    }

    /// Aborts request `id` wherever it is, giving back its tokens so far (none for a queued
    /// request that never ran), a running one's slot and pages freed at once (its finish reason
    /// [`FinishReason::Abort`]). `None` for an id that is neither queued nor running.
    pub fn abort(&mut self, id: u64) -> Option<Sample> {
        if let Some(i) = self.queue.iter().position(|q| q.sample.id == id) {
            return Some(self.queue.remove(i)?.finish(FinishReason::Abort));
        }
        let slot = self
            .running
            .iter()
            .position(|r| r.as_ref().is_some_and(|r| r.sample.id == id))?;
        self.vacate(slot).map(|r| r.finish(FinishReason::Abort))
    }

    /// Takes the request out of slot `slot`, its pages released.
    fn vacate(&mut self, slot: usize) -> Option<Running> {
        if let Some(p) = &mut self.pages {
            p.release(slot);
        }
        self.running.get_mut(slot)?.take()
    }

    /// Free KV pages of each group of a paged decoder's slots (empty for a decoder that is not
    /// paged, or before the first step).
    pub fn free_pages(&self) -> Vec<usize> {
        self.pages.as_ref().map_or_else(Vec::new, |p| {
            let groups = self
                .running
                .len()
                .div_ceil(p.paging().slots_per_group.max(1));
            (0..groups).map(|g| p.free(g)).collect()
        })
    }

    /// Aborts every queued and running request (in id order).
    pub fn abort_all(&mut self) -> Vec<Sample> {
        let mut ids: Vec<u64> = self.queue.iter().map(|q| q.sample.id).collect();
        ids.extend(self.running.iter().flatten().map(|r| r.sample.id));
        ids.sort_unstable();
        ids.into_iter().filter_map(|id| self.abort(id)).collect()
    }

    /// The weight version the next tokens are sampled on (each token records it in
    /// [`Sample::versions`]). Changing it is the caller's statement that the decoder now holds
    /// other weights: a request that ran on the old ones must have been preempted
    /// ([`Scheduler::preempt_all`]) or finished, since its KV is of the old weights; this is
    /// refused while any request holds a slot.
    pub fn set_version(&mut self, version: u64) -> Result<(), DecodeError> {
        if version != self.version && self.running() > 0 {
            return Err(DecodeError::Usage(format!(
                "{} requests hold KV of weight version {}: preempt or abort them before \
                 sampling on version {version}",
                self.running(),
                self.version
            )));
        }
        self.version = version;
        Ok(())
    }

    /// The weight version tokens are sampled on.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Takes every running request out of its slot and puts it back at the head of the queue
    /// (in id order) with the tokens it has: its KV is dropped, and when it is admitted again
    /// its prompt and tokens are prefilled anew, on the weights of that step (a partial
    /// rollout). Its draws go on where they were, so given equal logits it samples what it
    /// would have without the preemption.
    pub fn preempt_all(&mut self) {
        let mut back: Vec<Running> = (0..self.running.len())
            .filter_map(|s| self.vacate(s))
            .collect();
        back.sort_by_key(|r| r.sample.id);
        for r in back.into_iter().rev() {
            self.queue.push_front(r);
        }
    }

    /// Aborts every queued or running request holding a token sampled on a weight version
    /// older than `max_staleness` versions before the current one (so never trained on
    /// silently); the dropped samples, in id order.
    pub fn drop_stale(&mut self, max_staleness: u64) -> Vec<Sample> {
        let oldest_allowed = self.version.saturating_sub(max_staleness);
        let stale = |r: &Running| {
            r.sample
                .versions
                .first()
                .is_some_and(|&v| v < oldest_allowed)
        };
        let mut ids: Vec<u64> = self
            .queue
            .iter()
            .chain(self.running.iter().flatten())
            .filter(|r| stale(r))
            .map(|r| r.sample.id)
            .collect();
        ids.sort_unstable();
        ids.into_iter().filter_map(|id| self.abort(id)).collect()
    }

    /// One step: admits queued requests into free slots (in order, lowest slot first) and
    /// prefills them, then feeds every running request one token; the samples that finished in
    /// it, their slots freed. With [mixed steps](Scheduler::with_mixed_steps) the admitted
    /// requests are prefilled in the call that feeds the running ones.
    pub fn step<D: SlotDecoder>(&mut self, decoder: &mut D) -> Result<Vec<Sample>, D::Error> {
        if decoder.slots() == 0 && !self.queue.is_empty() {
            return Err(DecodeError::Usage(
                "the decoder has no KV slots: nothing queued can ever run".into(),
            )
            .into());
        }
        if self.running.len() != decoder.slots() {
            if self.running() > 0 {
                return Err(DecodeError::Usage(format!(
                    "the decoder now has {} KV slots; its {} running requests were admitted \
                     into {} (abort them first)",
                    decoder.slots(),
                    self.running(),
                    self.running.len()
                ))
                .into());
            }
            self.running = vec![None; decoder.slots()];
            // the pages' ledger is made anew for the new slots below
            self.pages = None;
        }
        let paging = decoder.paging();
        if self.pages.as_ref().map(KvPages::paging) != paging {
            if self.running() > 0 {
                return Err(DecodeError::Usage(format!(
                    "the decoder's KV paging changed while {} requests hold its pages (abort \
                     them first)",
                    self.running()
                ))
                .into());
            }
            self.pages = paging.map(|p| KvPages::new(p, self.running.len()));
        }
        let mut done = Vec::new();
        if self.mixed {
            self.mixed_step(decoder, &mut done)?;
            self.check_progress(&done)?;
            done.sort_by_key(|s| s.id);
            return Ok(done);
        }
        self.admit(decoder, &mut done)?;
        let slots: Vec<usize> = (0..self.running.len())
            .filter(|&s| self.running[s].is_some())
            .collect();
        if !slots.is_empty() {
            let rows: Vec<(usize, u32)> = slots
                .iter()
                .filter_map(|&s| self.running[s].as_ref().map(|r| (s, r.last())))
                .collect();
            let draws = self.draw(&slots);
            let picks = self.picks(&slots, &draws);
            let picked = decoder.decode_slots(&rows, &picks)?;
            self.steps += 1;
            self.rows += rows.len() as u64;
            self.take(&slots, picked, &mut done)?;
        }
        self.check_progress(&done)?;
        done.sort_by_key(|s| s.id);
        Ok(done)
    }

    /// A step that finished nothing and left nothing running while requests queue would be
    /// repeated forever: an error naming what the first queued request needs (the submit checks
    /// make it unreachable; a decoder whose room shrank since could reach it).
    fn check_progress(&self, done: &[Sample]) -> Result<(), DecodeError> {
        let Some(head) = self.queue.front() else {
            return Ok(());
        };
        if self.running() > 0 || !done.is_empty() {
            return Ok(());
        }
        let free = self.free_pages();
        Err(DecodeError::Usage(format!(
            "request {} ({} KV positions) cannot be admitted into an idle decoder of {} slots \
             (free KV pages per replica: {free:?}); abort it",
            head.sample.id,
            head.request.positions(),
            self.running.len()
        )))
    }

    /// A step of [`Scheduler::with_mixed_steps`]: the running requests fed and what fits the
    /// free slots admitted, in one [`SlotDecoder::mixed_slots`] call.
    fn mixed_step<D: SlotDecoder>(
        &mut self,
        decoder: &mut D,
        done: &mut Vec<Sample>,
    ) -> Result<(), D::Error> {
        let fed: Vec<usize> = (0..self.running.len())
            .filter(|&s| self.running[s].is_some())
            .collect();
        let admitted = self.seat(done, decoder.shares_prefixes());
        if fed.is_empty() && admitted.is_empty() {
            return Ok(());
        }
        self.map_pages(decoder, &admitted)?;
        let rows: Vec<(usize, u32)> = fed
            .iter()
            .filter_map(|&s| self.running[s].as_ref().map(|r| (s, r.last())))
            .collect();
        let draws = (self.draw(&admitted), self.draw(&fed));
        let contexts: Vec<Vec<u32>> = admitted
            .iter()
            .filter_map(|&s| self.running[s].as_ref().map(Running::context))
            .collect();
        let prompts: Vec<(usize, &[u32])> = admitted
            .iter()
            .zip(&contexts)
            .map(|(&s, c)| (s, c.as_slice()))
            .collect();
        let picks = (self.picks(&admitted, &draws.0), self.picks(&fed, &draws.1));
        let (first, next) = decoder.mixed_slots((&prompts, &picks.0), (&rows, &picks.1))?;
        if !rows.is_empty() {
            self.steps += 1;
            self.rows += rows.len() as u64;
        }
        self.take(&admitted, first, done)?;
        Ok(self.take(&fed, next, done)?)
    }

    /// Moves queued requests into the free slots (in order, lowest slot first; on a paged
    /// decoder only while the first queued request's pages are free in the slot's group,
    /// `shares`: sharing the full pages of an equal context admitted before it in this call);
    /// the slots filled. A request that may draw no token finishes at once.
    fn seat(&mut self, done: &mut Vec<Sample>, shares: bool) -> Vec<usize> {
        let mut slots: Vec<usize> = Vec::new();
        let mut contexts: Vec<Vec<u32>> = Vec::new();
        for s in 0..self.running.len() {
            while self.running[s].is_none() {
                let Some(head) = self.queue.front() else {
                    break;
                };
                if head.request.params.max_new_tokens == 0 {
                    if let Some(r) = self.queue.pop_front() {
                        done.push(r.finish(FinishReason::Length));
                    }
                    continue;
                }
                let context = head.context();
                if let Some(pages) = &mut self.pages {
                    let g = pages.group(s);
                    let leader = slots
                        .iter()
                        .zip(&contexts)
                        .find(|&(&l, c)| shares && pages.group(l) == g && *c == context)
                        .map(|(&l, _)| (l, context.len()));
                    if pages.hold(s, head.request.positions(), leader).is_none() {
                        break;
                    }
                }
                let Some(r) = self.queue.pop_front() else {
                    break;
                };
                self.running[s] = Some(r);
                slots.push(s);
                contexts.push(context);
            }
        }
        slots
    }

    /// Maps the pages of the requests admitted into `slots` (a paged decoder's).
    fn map_pages<D: SlotDecoder>(&self, decoder: &mut D, slots: &[usize]) -> Result<(), D::Error> {
        if let Some(pages) = &self.pages {
            let tables: Vec<(usize, &[u32])> = slots.iter().map(|&s| (s, pages.table(s))).collect();
            if !tables.is_empty() {
                decoder.map_pages(&tables)?;
            }
        }
        Ok(())
    }

    /// Admits and prefills what fits the free slots.
    fn admit<D: SlotDecoder>(
        &mut self,
        decoder: &mut D,
        done: &mut Vec<Sample>,
    ) -> Result<(), D::Error> {
        let slots = self.seat(done, decoder.shares_prefixes());
        if slots.is_empty() {
            return Ok(());
        }
        self.map_pages(decoder, &slots)?;
        let draws = self.draw(&slots);
        let contexts: Vec<Vec<u32>> = slots
            .iter()
            .filter_map(|&s| self.running[s].as_ref().map(Running::context))
            .collect();
        let admitted: Vec<(usize, &[u32])> = slots
            .iter()
            .zip(&contexts)
            .map(|(&s, c)| (s, c.as_slice()))
            .collect();
        let picks = self.picks(&slots, &draws);
        let picked = decoder.prefill_slots(&admitted, &picks)?;
        Ok(self.take(&slots, picked, done)?)
    }

    /// The next draw of each running request of `slots`.
    fn draw(&mut self, slots: &[usize]) -> Vec<f32> {
        slots
            .iter()
            .filter_map(|&s| self.running[s].as_mut().map(Running::draw))
            .collect()
    }

    /// How each running request of `slots` picks, with its draw.
    fn picks(&self, slots: &[usize], draws: &[f32]) -> Vec<PickArgs<'_>> {
        slots
            .iter()
            .zip(draws)
            .filter_map(|(&s, &uniform)| {
                let r = self.running[s].as_ref()?;
                Some(PickArgs {
                    params: &r.request.params,
                    uniform,
                })
            })
            .collect()
    }

    /// Appends each slot's picked token; finished samples leave their slots.
    fn take(
        &mut self,
        slots: &[usize],
        picked: Vec<Picked>,
        done: &mut Vec<Sample>,
    ) -> Result<(), DecodeError> {
        if picked.len() != slots.len() {
            return Err(DecodeError::Usage(format!(
                "the decoder picked {} tokens for {} rows",
                picked.len(),
                slots.len()
            )));
        }
        let version = self.version;
        for (&s, p) in slots.iter().zip(picked) {
            let finished = self.running[s].as_mut().and_then(|r| r.push(p, version));
            if let Some(why) = finished
                && let Some(r) = self.vacate(s)
            {
                done.push(r.finish(why));
            }
        }
        Ok(())
    }

    /// Submits every request (all checked first: one refused queues none, its index named),
    /// steps until all finished, and returns their samples in request order.
    pub fn run<D: SlotDecoder>(
        &mut self,
        decoder: &mut D,
        requests: Vec<Request>,
    ) -> Result<Vec<Sample>, D::Error> {
        let vocab = decoder.vocab_size();
        for (i, r) in requests.iter().enumerate() {
            r.check(vocab).map_err(|e| e.in_request(i))?;
            check_room(decoder, r).map_err(|e| e.in_request(i))?;
        }
        let first = self.next_id;
        for r in requests {
            self.submit(decoder, r)?;
        }
        let mut out = Vec::new();
        while !self.is_idle() {
            out.extend(self.step(decoder)?);
        }
        out.retain(|s| s.id >= first);
        out.sort_by_key(|s| s.id);
        Ok(out)
    }
}

/// Whether `request` can ever run on `decoder`: its prompt and every token it may sample fit one
/// slot, and, on a paged decoder, the pages of one group.
fn check_room<D: SlotDecoder>(decoder: &D, request: &Request) -> Result<(), DecodeError> {
    let (need, room) = (request.positions(), decoder.slot_positions());
    let prompt = request.prompt.len();
    if need > room {
        return Err(DecodeError::Request {
            request: None,
            field: "max_new_tokens",
            problem: format!(
                "with a prompt of {prompt} tokens needs {need} KV positions; a slot holds {room} \
                 (raise the engine's max_tokens or lower max_new_tokens)"
            ),
        });
    }
    if let Some(p) = decoder.paging() {
        let pages = p.pages_for(need);
        if pages > p.pages_per_group {
            return Err(DecodeError::Request {
                request: None,
                field: "max_new_tokens",
                problem: format!(
                    "with a prompt of {prompt} tokens needs {need} KV positions: {pages} pages \
                     of {}; the KV cache holds {} pages per replica (raise the engine's \
                     kv_tokens or lower max_new_tokens)",
                    p.page_positions, p.pages_per_group
                ),
            });
        }
    }
    Ok(())
}
