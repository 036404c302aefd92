//! Properties of the continuous-batching scheduler over any schedule: every request comes back
//! once, its finish reason agrees with its tokens, and its samples are the same whatever the
//! slot count, the KV pages and wherever it is preempted (a decoder whose logits depend only on
//! a sequence's tokens, as a model's do); on a paged decoder no page is written while another
//! sequence reads it, and no page lies outside the cache.

use lifecycle_decoder::{
    pick, DecodeError, FinishReason, KvPaging, PickArgs, Picked, Request, Sample, SamplingParams,
    Scheduler, SlotDecoder, SplitMix64,
};
use proptest::prelude::*;

const VOCAB: usize = 16;

/// Logits that are a function of the sequence's tokens only (like a model's), per slot.
/// Paged (pages of [`PAGE`] positions in groups of `slots_per_group`), it keeps each slot's
/// page table and checks every pass against it.
struct Hashed {
    slots: usize,
    seqs: Vec<Vec<u32>>,
    paging: Option<KvPaging>,
    tables: Vec<Vec<u32>>,
    /// Pages held at once, at most.
    most_pages: usize,
}

const PAGE: usize = 4;

impl Hashed {
    fn new(slots: usize) -> Self {
        Hashed {
            slots,
            seqs: vec![Vec::new(); slots],
            paging: None,
            tables: vec![Vec::new(); slots],
            most_pages: 0,
        }
    }

    fn paged(slots: usize, per_group: usize, pages: usize) -> Self {
        let mut d = Self::new(slots);
        d.paging = Some(KvPaging {
            page_positions: PAGE,
            pages_per_group: pages,
            slots_per_group: per_group,
        });
        d
    }

    /// After slots `fed` were written (a decode step: at their last position; a prefill: the
    /// leader of a shared prompt writes its pages): each holds pages for its positions, and a
    /// page two of them hold is a full page of equal tokens that a decode step does not write.
    fn check_pages(&mut self, fed: &[usize], decode: bool) -> Result<(), DecodeError> {
        let Some(p) = self.paging else {
            return Ok(());
        };
        let bad = |m: String| Err(DecodeError::Usage(m));
        let mut held = std::collections::BTreeSet::new();
        for (i, &a) in fed.iter().enumerate() {
            let (ta, sa) = (&self.tables[a], &self.seqs[a]);
            if ta.len() * PAGE < sa.len() {
                return bad(format!(
                    "slot {a} holds {} positions in {} pages",
                    sa.len(),
                    ta.len()
                ));
            }
            for &page in ta {
                held.insert((a / p.slots_per_group, page));
            }
            for &b in &fed[i + 1..] {
                let (tb, sb) = (&self.tables[b], &self.seqs[b]);
                for (j, (pa, pb)) in ta.iter().zip(tb).enumerate() {
                    let same_group = a / p.slots_per_group == b / p.slots_per_group;
                    if pa != pb || !same_group {
                        continue;
                    }
                    let end = (j + 1) * PAGE;
                    let shortest = sa.len().min(sb.len());
                    let written = shortest < end || (decode && shortest == end);
                    if written || sa[j * PAGE..end] != sb[j * PAGE..end] {
                        return bad(format!(
                            "slots {a} and {b} share page {pa} (#{j}) unequal or written"
                        ));
                    }
                }
            }
        }
        self.most_pages = self.most_pages.max(held.len());
        Ok(())
    }

    fn logits(seq: &[u32]) -> Vec<f32> {
        let keys: Vec<u64> = seq.iter().map(|&t| u64::from(t)).collect();
        let mut g = SplitMix64::from_keys(&keys);
        (0..VOCAB).map(|_| g.symmetric(3.0)).collect()
    }

    fn picked(seq: &[u32], a: &PickArgs<'_>) -> Picked {
        pick(&Self::logits(seq), a.params, a.uniform)
    }
}

impl SlotDecoder for Hashed {
    type Error = DecodeError;

    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn slot_positions(&self) -> usize {
        48
    }

    fn paging(&self) -> Option<KvPaging> {
        self.paging
    }

    fn map_pages(&mut self, tables: &[(usize, &[u32])]) -> Result<(), DecodeError> {
        let p = self
            .paging
            .ok_or_else(|| DecodeError::Usage("not paged".into()))?;
        for &(s, pages) in tables {
            if pages.iter().any(|&x| x as usize >= p.pages_per_group) {
                return Err(DecodeError::Usage(format!(
                    "slot {s}: a page past the cache"
                )));
            }
            self.tables[s] = pages.to_vec();
        }
        Ok(())
    }

    fn shares_prefixes(&self) -> bool {
        self.paging.is_some()
    }

    fn prefill_slots(
        &mut self,
        admitted: &[(usize, &[u32])],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, DecodeError> {
        let out = admitted
            .iter()
            .zip(picks)
            .map(|(&(s, p), a)| {
                self.seqs[s] = p.to_vec();
                Self::picked(p, a)
            })
            .collect();
        let fed: Vec<usize> = admitted.iter().map(|a| a.0).collect();
        self.check_pages(&fed, false)?;
        Ok(out)
    }

    fn decode_slots(
        &mut self,
        rows: &[(usize, u32)],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, DecodeError> {
        let out = rows
            .iter()
            .zip(picks)
            .map(|(&(s, t), a)| {
                self.seqs[s].push(t);
                Self::picked(&self.seqs[s], a)
            })
            .collect();
        let fed: Vec<usize> = rows.iter().map(|r| r.0).collect();
        self.check_pages(&fed, true)?;
        Ok(out)
    }
}

fn request() -> impl Strategy<Value = Request> {
    (
        prop::collection::vec(0u32..VOCAB as u32, 1..6),
        0usize..20,
        prop_oneof![Just(0.0f32), 0.3f32..2.0],
        prop_oneof![Just(1.0f32), 0.05f32..1.0],
        prop::option::of(1u32..8),
        prop::collection::vec(0u32..VOCAB as u32, 0..3),
        any::<u64>(),
    )
        .prop_map(|(prompt, n, t, p, k, stops, seed)| {
            let mut s = SamplingParams::new(n)
                .with_temperature(t)
                .with_top_p(p)
                .with_stop_tokens(stops)
                .with_seed(seed);
            s.top_k = k;
            Request::new(prompt, s)
        })
}

/// Runs `reqs` on `slots` slots, preempting every running request at the steps in `preempt`.
fn serve(reqs: &[Request], slots: usize, preempt: &[usize]) -> Vec<Sample> {
    serve_on(Hashed::new(slots), reqs, preempt, false).0
}

/// Runs `reqs` on `d` as [`serve`] does (`mixed`: admitted requests prefilled in the pass that
/// feeds the others); the samples and the most pages held at once.
fn serve_on(
    mut d: Hashed,
    reqs: &[Request],
    preempt: &[usize],
    mixed: bool,
) -> (Vec<Sample>, usize) {
    let mut s = Scheduler::new().with_mixed_steps(mixed);
    for r in reqs {
        s.submit(&d, r.clone()).unwrap();
    }
    let mut out = Vec::new();
    let mut step = 0;
    while !s.is_idle() {
        if preempt.contains(&step) {
            s.preempt_all();
        }
        out.extend(s.step(&mut d).unwrap());
        step += 1;
    }
    out.sort_by_key(|x| x.id);
    (out, d.most_pages)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_schedule_gives_each_request_its_own_samples(
        reqs in prop::collection::vec(request(), 1..12),
        slots in 1usize..6,
        preempt in prop::collection::vec(0usize..30, 0..3),
    ) {
        let alone: Vec<Sample> = reqs.iter().map(|r| serve(std::slice::from_ref(r), 1, &[]).remove(0)).collect();
        let got = serve(&reqs, slots, &preempt);
        prop_assert_eq!(got.len(), reqs.len());
        for (i, (s, r)) in got.iter().zip(&reqs).enumerate() {
            prop_assert_eq!(s.id, i as u64);
            prop_assert_eq!(&s.tokens, &alone[i].tokens);
            prop_assert_eq!(&s.logprobs, &alone[i].logprobs);
            prop_assert!(s.tokens.len() <= r.params.max_new_tokens);
            prop_assert_eq!(s.logprobs.len(), s.tokens.len());
            prop_assert_eq!(s.versions.len(), s.tokens.len());
            let body = &s.tokens[..s.tokens.len().saturating_sub(1)];
            prop_assert!(body.iter().all(|&t| !r.params.stops_at(t)));
            match s.finish {
                FinishReason::Stop => prop_assert!(r.params.stops_at(*s.tokens.last().unwrap())),
                FinishReason::Length => prop_assert_eq!(s.tokens.len(), r.params.max_new_tokens),
                FinishReason::Abort => prop_assert!(false, "nothing was aborted"),
            }
            // greedy rows are the argmax; every picked token lies in the vocabulary
            prop_assert!(s.tokens.iter().all(|&t| (t as usize) < VOCAB));
            if r.params.greedy() {
                prop_assert!(s.truncated_logprobs.iter().all(|&x| x == 0.0));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn paged_schedules_give_each_request_its_own_samples(
        reqs in prop::collection::vec(request(), 1..8),
        samples in 1usize..4,
        (slots, per_group) in (1usize..5).prop_flat_map(|g| (g..=2 * g, Just(g))),
        spare in 0usize..12,
        preempt in prop::collection::vec(0usize..30, 0..3),
        mixed in any::<bool>(),
    ) {
        // each prompt sampled `samples` times (a group: admitted together, they share pages)
        let reqs: Vec<Request> = reqs
            .iter()
            .flat_map(|r| (0..samples as u64).map(move |i| {
                let mut r = r.clone();
                r.prompt.extend([1, 2, 3]);
                r.params.seed = r.params.seed.wrapping_add(i);
                r
            }))
            .collect();
        let alone: Vec<Sample> = reqs.iter().map(|r| serve(std::slice::from_ref(r), 1, &[]).remove(0)).collect();
        // room for the longest request, and `spare` pages more
        let pages = reqs.iter().map(|r| r.positions().div_ceil(PAGE)).max().unwrap_or(1) + spare;
        let (got, most) = serve_on(Hashed::paged(slots, per_group, pages), &reqs, &preempt, mixed);
        prop_assert_eq!(got.len(), reqs.len());
        let groups = slots.div_ceil(per_group);
        prop_assert!(most <= pages * groups, "{} pages held of {}", most, pages * groups);
        for (i, s) in got.iter().enumerate() {
            prop_assert_eq!(&s.tokens, &alone[i].tokens);
            prop_assert_eq!(&s.logprobs, &alone[i].logprobs);
        }
    }
}

#[test]
fn a_paged_decoder_admits_in_order_while_the_pages_last_and_refuses_what_never_fits() {
    let req = |prompt: Vec<u32>, n: usize| Request::new(prompt, SamplingParams::new(n));
    // 11 pages of 4 positions, 4 slots in one group
    let mut d = Hashed::paged(4, 4, 11);
    let mut s = Scheduler::new();
    // 8 + 24 - 1 = 31 positions: 8 pages; then two of 2 pages, the second sharing a page
    let long = req(vec![1; 8], 24);
    s.submit(&d, long).unwrap();
    s.submit(&d, req(vec![5; 4], 4)).unwrap();
    s.submit(&d, req(vec![5; 4], 4)).unwrap();
    s.submit(&d, req(vec![6], 3)).unwrap();
    s.step(&mut d).unwrap();
    // 8 + 2 + 1 own (its prompt's page shared) = 11: the last request (1 page) waits
    assert_eq!((s.running(), s.queued()), (3, 1));
    assert_eq!(s.free_pages(), vec![0]);
    // one page more than the cache: refused by name at submit
    let e = s.submit(&d, req(vec![1; 4], 44)).unwrap_err().to_string();
    assert!(
        e.contains("12 pages") && e.contains("11 pages per replica"),
        "{e}"
    );
    while !s.is_idle() {
        s.step(&mut d).unwrap();
    }
    assert_eq!(s.free_pages(), vec![11]);
}

#[test]
fn a_request_that_no_longer_fits_an_idle_decoder_is_an_error_not_a_hang() {
    let mut d = Hashed::paged(2, 2, 10);
    let mut s = Scheduler::new();
    // 8 + 24 - 1 = 31 positions: 8 pages of the 10
    s.submit(&d, Request::new(vec![1; 8], SamplingParams::new(24)))
        .unwrap();
    // the decoder's cache shrinks before the first step: the request can never be admitted
    d.paging = Some(KvPaging {
        page_positions: PAGE,
        pages_per_group: 2,
        slots_per_group: 2,
    });
    let e = s.step(&mut d).unwrap_err().to_string();
    assert!(e.contains("request 0") && e.contains("[2]"), "{e}");
    assert_eq!(s.queued(), 1);
}
