//! Properties of the continuous-batching scheduler over any schedule: every request comes back
//! once, its finish reason agrees with its tokens, and its samples are the same whatever the
//! slot count and wherever it is preempted (a decoder whose logits depend only on a sequence's
//! tokens, as a model's do).

use lifecycle_decoder::{
    pick, DecodeError, FinishReason, PickArgs, Picked, Request, Sample, SamplingParams, Scheduler,
    SlotDecoder, SplitMix64,
};
use proptest::prelude::*;

const VOCAB: usize = 16;

/// Logits that are a function of the sequence's tokens only (like a model's), per slot.
struct Hashed {
    slots: usize,
    seqs: Vec<Vec<u32>>,
}

impl Hashed {
    fn new(slots: usize) -> Self {
        Hashed {
            slots,
            seqs: vec![Vec::new(); slots],
        }
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

    fn prefill_slots(
        &mut self,
        admitted: &[(usize, &[u32])],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, DecodeError> {
        Ok(admitted
            .iter()
            .zip(picks)
            .map(|(&(s, p), a)| {
                self.seqs[s] = p.to_vec();
                Self::picked(p, a)
            })
            .collect())
    }

    fn decode_slots(
        &mut self,
        rows: &[(usize, u32)],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, DecodeError> {
        Ok(rows
            .iter()
            .zip(picks)
            .map(|(&(s, t), a)| {
                self.seqs[s].push(t);
                Self::picked(&self.seqs[s], a)
            })
            .collect())
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
    let mut d = Hashed::new(slots);
    let mut s = Scheduler::new();
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
    out
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
