//! DAPO's dynamic sampling, streamed ([`GroupStream`]): prompt groups are submitted as slots
//! free up instead of in whole generation batches, a group is scored as soon as its last sample
//! finishes, and generation stops once enough groups are kept; the requests still in flight are
//! then aborted (their KV freed at once) or, as partial rollouts, kept to continue after the
//! update on the new weights, each token's weight version recorded and a sample more than
//! `max_staleness` versions old dropped, never trained on.
//!
//! Aborting favours short samples: the groups that finish first are the ones kept, so kept
//! samples are shorter than generated ones on average (each [`Filled`] reports both means).
//! Partial rollouts avoid that bias: a long sample is continued, not thrown away.

use std::collections::BTreeMap;

use crate::error::DecodeError;
use crate::rollout::request::{Request, Sample};
use crate::rollout::scheduler::{Scheduler, SlotDecoder};

/// What happens to the requests still in flight once a step's groups are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leftovers {
    /// Aborted: their slots and KV freed at once, their tokens thrown away.
    Abort,
    /// Kept as partial rollouts: preempted (KV dropped) and continued at the next fill, on the
    /// weights of then; a sample holding a token more than `max_staleness` versions older than
    /// the current weights is dropped.
    Partial {
        /// Versions a sample's first token may lag the current weights by.
        max_staleness: u64,
    },
}

/// One step's fill: the kept groups and what it cost.
#[derive(Debug, Clone, Default)]
pub struct Filled {
    /// The kept groups' samples, each group in sample order, groups in the order they were kept.
    pub kept: Vec<Vec<Sample>>,
    /// Groups finished and not kept (scored out, or finished once `want` were kept).
    pub dropped_groups: usize,
    /// Samples finished in this fill (kept or not), and their tokens.
    pub finished: usize,
    /// Tokens of every sample finished in this fill.
    pub finished_tokens: usize,
    /// Requests aborted at the end of the fill ([`Leftovers::Abort`]), with their tokens.
    pub aborted: usize,
    /// Tokens the aborted requests had sampled.
    pub aborted_tokens: usize,
    /// Requests carried to the next fill ([`Leftovers::Partial`]).
    pub carried: usize,
    /// Samples dropped as stale at the start of this fill (their groups dropped with them).
    pub stale: usize,
    /// Scheduler steps (decode passes) of this fill.
    pub steps: u64,
}

impl Filled {
    /// Mean tokens of a kept sample.
    pub fn kept_mean_len(&self) -> f64 {
        let (n, t) = self
            .kept
            .iter()
            .flatten()
            .fold((0usize, 0usize), |(n, t), s| (n + 1, t + s.tokens.len()));
        t as f64 / n.max(1) as f64
    }

    /// Mean tokens of a sample finished in the fill (kept or not).
    pub fn finished_mean_len(&self) -> f64 {
        self.finished_tokens as f64 / self.finished.max(1) as f64
    }
}

/// A group in flight: its requests' ids and the samples finished so far.
#[derive(Debug, Clone)]
struct Group {
    ids: Vec<u64>,
    done: Vec<Option<Sample>>,
}

/// DAPO's dynamic sampling over a [`Scheduler`] ([the module](self)).
///
/// ```
/// use lifecycle_decoder::{GroupStream, Leftovers, Request, SamplingParams};
/// # use lifecycle_decoder::{PickArgs, Picked, SlotDecoder, DecodeError};
/// # struct Count;
/// # impl SlotDecoder for Count {
/// #     type Error = DecodeError;
/// #     fn vocab_size(&self) -> usize { 100 }
/// #     fn slots(&self) -> usize { 4 }
/// #     fn slot_positions(&self) -> usize { 64 }
/// #     fn prefill_slots(&mut self, a: &[(usize, &[u32])], _: &[PickArgs<'_>]) -> Result<Vec<Picked>, DecodeError> {
/// #         Ok(a.iter().map(|(_, p)| one(p[p.len() - 1] + 1)).collect())
/// #     }
/// #     fn decode_slots(&mut self, r: &[(usize, u32)], _: &[PickArgs<'_>]) -> Result<Vec<Picked>, DecodeError> {
/// #         Ok(r.iter().map(|&(_, t)| one(t + 1)).collect())
/// #     }
/// # }
/// # fn one(token: u32) -> Picked { Picked { token, logprob: 0.0, raw_logprob: 0.0, truncated_logprob: 0.0 } }
/// let mut decoder = Count;
/// let mut stream = GroupStream::new(2, Leftovers::Abort);
/// // group g: two samples of prompt [g], g + 1 tokens each; keep the even groups
/// let group = |g: u64| Ok(vec![Request::new(vec![g as u32], SamplingParams::new(g as usize + 1)); 2]);
/// let filled = stream.fill(&mut decoder, 2, group, |g, _| Ok(g % 2 == 0))?;
/// assert_eq!(filled.kept.len(), 2);
/// assert_eq!(filled.kept[0][0].tokens, vec![1]);
/// assert_eq!(filled.dropped_groups, 1);
/// # Ok::<(), DecodeError>(())
/// ```
#[derive(Debug, Clone)]
pub struct GroupStream {
    scheduler: Scheduler,
    group_size: usize,
    leftovers: Leftovers,
    max_groups: Option<usize>,
    next_group: u64,
    groups: BTreeMap<u64, Group>,
    owner: BTreeMap<u64, (u64, usize)>,
}

impl GroupStream {
    /// Groups of `group_size` samples; in-flight requests at the end of a fill go as
    /// `leftovers` says.
    pub fn new(group_size: usize, leftovers: Leftovers) -> Self {
        GroupStream {
            scheduler: Scheduler::new(),
            group_size: group_size.max(1),
            leftovers,
            max_groups: None,
            next_group: 0,
            groups: BTreeMap::new(),
            owner: BTreeMap::new(),
        }
    }

    /// The same stream submitting at most `groups` new groups in one fill: once they are all
    /// submitted and nothing is left running, the fill returns what it kept, fewer than wanted
    /// (without a bound, a fill whose groups are never kept would run forever).
    ///
    /// ```
    /// use lifecycle_decoder::{GroupStream, Leftovers};
    /// let stream = GroupStream::new(16, Leftovers::Abort).with_max_groups(64);
    /// # let _ = stream;
    /// ```
    pub fn with_max_groups(mut self, groups: usize) -> Self {
        self.max_groups = Some(groups);
        self
    }

    /// The same stream with [mixed steps](Scheduler::with_mixed_steps): groups admitted as
    /// slots free up are prefilled in the pass that feeds the running requests.
    ///
    /// ```
    /// use lifecycle_decoder::{GroupStream, Leftovers};
    /// let stream = GroupStream::new(16, Leftovers::Abort).with_mixed_steps(true);
    /// # let _ = stream;
    /// ```
    pub fn with_mixed_steps(mut self, on: bool) -> Self {
        self.scheduler = std::mem::take(&mut self.scheduler).with_mixed_steps(on);
        self
    }

    /// The scheduler (its version, its counts).
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Sets the weight version of the next fill's tokens (after an update: the lifecycle's
    /// version of the new weights); refused while requests hold KV (a fill leaves none).
    pub fn set_version(&mut self, version: u64) -> Result<(), DecodeError> {
        self.scheduler.set_version(version)
    }

    /// Generates until `want` groups are kept: `group(g)` gives group `g`'s requests (numbered
    /// from 0 over the stream's life, `group_size` of them), submitted while fewer than a
    /// decoder's worth of requests wait; `keep(g, samples)` scores a group when its last sample
    /// finishes; with a bound ([`GroupStream::with_max_groups`]) a fill may return fewer. In-flight
    /// requests then go as the stream's [`Leftovers`] say. An error of a callback or of the
    /// decoder ends the fill with it, every request in flight aborted.
    pub fn fill<D: SlotDecoder>(
        &mut self,
        decoder: &mut D,
        want: usize,
        mut group: impl FnMut(u64) -> Result<Vec<Request>, D::Error>,
        mut keep: impl FnMut(u64, &[Sample]) -> Result<bool, D::Error>,
    ) -> Result<Filled, D::Error> {
        let out = self.fill_inner(decoder, want, &mut group, &mut keep);
        if out.is_err() {
            self.scheduler.abort_all();
            self.groups.clear();
            self.owner.clear();
        }
        out
    }

    fn fill_inner<D: SlotDecoder>(
        &mut self,
        decoder: &mut D,
        want: usize,
        group: &mut impl FnMut(u64) -> Result<Vec<Request>, D::Error>,
        keep: &mut impl FnMut(u64, &[Sample]) -> Result<bool, D::Error>,
    ) -> Result<Filled, D::Error> {
        let mut out = Filled::default();
        if let Leftovers::Partial { max_staleness } = self.leftovers {
            for s in self.scheduler.drop_stale(max_staleness) {
                out.stale += 1;
                self.forget_group_of(s.id);
            }
        }
        let steps_before = self.scheduler.counts().0;
        let mut submitted = 0usize;
        let budget = self.max_groups.unwrap_or(usize::MAX);
        while out.kept.len() < want {
            if submitted >= budget && self.scheduler.is_idle() {
                break;
            }
            while self.scheduler.queued() < decoder.slots() && submitted < budget {
                let g = self.next_group;
                let requests = group(g)?;
                if requests.len() != self.group_size {
                    return Err(DecodeError::Usage(format!(
                        "group {g} has {} requests; the stream's groups have {}",
                        requests.len(),
                        self.group_size
                    ))
                    .into());
                }
                let mut ids = Vec::with_capacity(requests.len());
                for (i, r) in requests.into_iter().enumerate() {
                    let id = self
                        .scheduler
                        .submit(decoder, r)
                        .map_err(|e| e.in_request(i))?;
                    self.owner.insert(id, (g, i));
                    ids.push(id);
                }
                let done = vec![None; ids.len()];
                self.groups.insert(g, Group { ids, done });
                self.next_group += 1;
                submitted += 1;
            }
            for s in self.scheduler.step(decoder)? {
                out.finished += 1;
                out.finished_tokens += s.tokens.len();
                let Some((g, i)) = self.owner.remove(&s.id) else {
                    continue;
                };
                let Some(grp) = self.groups.get_mut(&g) else {
                    continue;
                };
                grp.done[i] = Some(s);
                if grp.done.iter().all(Option::is_some) {
                    let samples: Vec<Sample> = self
                        .groups
                        .remove(&g)
                        .map(|grp| grp.done.into_iter().flatten().collect())
                        .unwrap_or_default();
                    if out.kept.len() < want && keep(g, &samples)? {
                        out.kept.push(samples);
                    } else {
                        out.dropped_groups += 1;
                    }
                }
            }
        }
        match self.leftovers {
            Leftovers::Abort => {
                for s in self.scheduler.abort_all() {
                    out.aborted += 1;
                    out.aborted_tokens += s.tokens.len();
                    self.owner.remove(&s.id);
                }
                self.groups.clear();
            }
            Leftovers::Partial { .. } => {
                out.carried = self.scheduler.running() + self.scheduler.queued();
                self.scheduler.preempt_all();
            }
        }
        out.steps = self.scheduler.counts().0 - steps_before;
        Ok(out)
    }

    /// Drops the group of request `id` (one of its samples was dropped): its other requests
    /// are aborted.
    fn forget_group_of(&mut self, id: u64) {
        let Some((g, _)) = self.owner.remove(&id) else {
            return;
        };
        if let Some(grp) = self.groups.remove(&g) {
            for other in grp.ids {
                if self.owner.remove(&other).is_some() {
                    self.scheduler.abort(other);
                }
            }
        }
    }
}
