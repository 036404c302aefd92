//! Continuous batching on the CPU decoder (the reference): a request's tokens and log-probs are
//! bitwise the same whatever shares its steps and however many slots there are; finish reasons,
//! aborts, and bad requests refused by name before anything runs.

use lifecycle_core::Lifecycle;
use lifecycle_decoder::{
    random_tensors, CpuDecoder, DecodeError, Decoder, FinishReason, ModelConfig, PrefillLogits,
    Request, Sample, SamplingParams, Scheduler,
};
use lifecycle_host::{HostBackend, HostTrainState};

fn config() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 48, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0}"#,
    )
    .unwrap()
}

/// DAPO-shaped requests: groups of 4 samples of a prompt, long-tailed lengths, stops,
/// temperature / top-p / top-k mixed, a greedy one.
fn requests() -> Vec<Request> {
    let mut out = Vec::new();
    for g in 0..4u32 {
        let prompt: Vec<u32> = (0..3 + g).map(|i| (7 * g + 3 * i + 1) % 48).collect();
        for j in 0..4u32 {
            let n = g * 4 + j;
            let mut p = SamplingParams::new([3, 9, 2, 14, 5][(n % 5) as usize])
                .with_temperature([1.0, 0.7, 1.3, 0.0][(n % 4) as usize])
                .with_seed(1000 + u64::from(n));
            if n % 3 == 0 {
                p = p.with_top_p(0.9);
            }
            if n % 5 == 1 {
                p = p.with_top_k(5);
            }
            if n % 2 == 0 {
                p = p.with_stop_tokens(vec![2, 11, 17, 23, 29, 35, 40, 44]);
            }
            out.push(Request::new(prompt.clone(), p));
        }
    }
    out
}

fn with_decoder<R>(f: impl FnOnce(CpuDecoder<'_>) -> R) -> R {
    let c = config();
    let layout = c.rollout_layout(2).unwrap();
    let state = HostTrainState::from_tensors(2, random_tensors(&c, 3)).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let session = lc.rollout().unwrap();
    let weights = session.weights();
    let group: Vec<_> = weights.ranks.iter().collect();
    f(CpuDecoder::new(&c, &layout, &group).unwrap())
}

fn run(slots: usize, reqs: Vec<Request>) -> Vec<Sample> {
    with_decoder(|d| {
        let mut d = d.with_slots(slots, 64);
        Scheduler::new().run(&mut d, reqs).unwrap()
    })
}

#[test]
fn a_request_samples_the_same_however_it_is_batched() {
    let reqs = requests();
    let wide = run(64, reqs.clone());
    let narrow = run(3, reqs.clone());
    assert_eq!(wide.len(), reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        let alone = run(1, vec![r.clone()]).remove(0);
        for s in [&wide[i], &narrow[i]] {
            assert_eq!(s.id, i as u64);
            assert_eq!(s.tokens, alone.tokens, "request {i}");
            assert_eq!(s.logprobs, alone.logprobs, "request {i}");
            assert_eq!(s.raw_logprobs, alone.raw_logprobs, "request {i}");
            assert_eq!(s.finish, alone.finish, "request {i}");
        }
        let s = &wide[i];
        assert_eq!(s.logprobs.len(), s.tokens.len());
        match s.finish {
            FinishReason::Stop => {
                assert!(r.params.stops_at(*s.tokens.last().unwrap()));
                assert!(s.tokens.len() <= r.params.max_new_tokens);
            }
            FinishReason::Length => assert_eq!(s.tokens.len(), r.params.max_new_tokens),
            FinishReason::Abort => panic!("nothing was aborted"),
        }
        // no stop token before the last
        let body = &s.tokens[..s.tokens.len() - 1];
        assert!(body.iter().all(|&t| !r.params.stops_at(t)), "request {i}");
    }
    assert!(wide.iter().any(|s| s.finish == FinishReason::Stop));
    assert!(wide.iter().any(|s| s.finish == FinishReason::Length));
}

#[test]
fn mixed_steps_sample_what_separate_prefills_do() {
    let reqs = requests();
    let (between, mixed) = with_decoder(|d| {
        let mut d = d.with_slots(3, 64);
        let a = Scheduler::new().run(&mut d, reqs.clone()).unwrap();
        let b = Scheduler::new()
            .with_mixed_steps(true)
            .run(&mut d, reqs.clone())
            .unwrap();
        (a, b)
    });
    assert_eq!(between.len(), reqs.len());
    for (a, b) in between.iter().zip(&mixed) {
        assert_eq!((a.id, &a.tokens, a.finish), (b.id, &b.tokens, b.finish));
        assert_eq!(a.logprobs, b.logprobs);
        assert_eq!(a.truncated_logprobs, b.truncated_logprobs);
    }
}

#[test]
fn log_probs_are_those_of_the_teacher_forced_logits() {
    let r = Request::new(
        vec![5, 6, 7],
        SamplingParams::new(6).with_temperature(0.8).with_seed(9),
    );
    let s = run(4, vec![r.clone()]).remove(0);
    with_decoder(|mut d| {
        let mut seq = r.prompt.clone();
        seq.extend(&s.tokens[..s.tokens.len() - 1]);
        let rows = d.prefill(&[seq], PrefillLogits::All).unwrap().remove(0);
        let vocab = 48;
        for (k, &t) in s.tokens.iter().enumerate() {
            let row = &rows[(r.prompt.len() - 1 + k) * vocab..][..vocab];
            let lse = |scale: f64| {
                let top = row.iter().fold(f32::MIN, |m, &v| m.max(v)) as f64;
                let sum: f64 = row.iter().map(|&v| ((v as f64 - top) / scale).exp()).sum();
                (row[t as usize] as f64 - top) / scale - sum.ln()
            };
            assert!(
                (f64::from(s.logprobs[k]) - lse(0.8)).abs() < 1e-5,
                "token {k}"
            );
            assert!(
                (f64::from(s.raw_logprobs[k]) - lse(1.0)).abs() < 1e-5,
                "token {k}"
            );
            assert!(s.truncated_logprobs[k] >= s.logprobs[k]);
        }
    });
}

#[test]
fn an_abort_frees_the_slot_for_the_next_request() {
    with_decoder(|d| {
        let mut d = d.with_slots(1, 64);
        let mut s = Scheduler::new();
        let long = s
            .submit(&d, Request::new(vec![1, 2], SamplingParams::new(40)))
            .unwrap();
        let next = s
            .submit(&d, Request::new(vec![3], SamplingParams::new(2)))
            .unwrap();
        let queued = s
            .submit(&d, Request::new(vec![4], SamplingParams::new(2)))
            .unwrap();
        for _ in 0..3 {
            assert!(s.step(&mut d).unwrap().is_empty());
        }
        assert_eq!((s.running(), s.queued()), (1, 2));
        let a = s.abort(long).unwrap();
        assert_eq!((a.finish, a.tokens.len()), (FinishReason::Abort, 4));
        let q = s.abort(queued).unwrap();
        assert_eq!((q.finish, q.tokens.len()), (FinishReason::Abort, 0));
        assert_eq!(s.abort(queued), None);
        let done = s.step(&mut d).unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].id, done[0].finish), (next, FinishReason::Length));
        assert!(s.is_idle());
    });
}

#[test]
fn bad_requests_are_refused_by_name_before_anything_runs() {
    let good = Request::new(vec![1, 2], SamplingParams::new(4));
    let cases: Vec<(Request, &str)> = vec![
        (
            Request::new(vec![1], SamplingParams::new(4).with_top_p(0.0)),
            "top_p",
        ),
        (
            Request::new(vec![1], SamplingParams::new(4).with_top_p(1.01)),
            "top_p",
        ),
        (
            Request::new(vec![1], SamplingParams::new(4).with_top_k(0)),
            "top_k",
        ),
        (
            Request::new(vec![1], SamplingParams::new(4).with_temperature(-0.5)),
            "temperature",
        ),
        (
            Request::new(vec![1], SamplingParams::new(4).with_temperature(f32::NAN)),
            "temperature",
        ),
        (
            Request::new(
                vec![1],
                SamplingParams::new(4).with_stop_tokens(vec![3, 48]),
            ),
            "stop_tokens",
        ),
        (Request::new(vec![], SamplingParams::new(4)), "prompt"),
        (Request::new(vec![1, 99], SamplingParams::new(4)), "prompt"),
        (
            Request::new(vec![1; 60], SamplingParams::new(8)),
            "max_new_tokens",
        ),
    ];
    with_decoder(|d| {
        let mut d = d.with_slots(2, 64);
        let mut s = Scheduler::new();
        let kept = s.submit(&d, good.clone()).unwrap();
        s.step(&mut d).unwrap();
        for (bad, field) in cases {
            let e = s.submit(&d, bad.clone()).unwrap_err();
            assert!(
                matches!(&e, DecodeError::Request { field: f, .. } if *f == field),
                "{e}"
            );
            assert!(e.to_string().contains(field), "{e}");
            // a call of several names the request at fault and queues none
            let e = Scheduler::new()
                .run(&mut d, vec![good.clone(), bad])
                .unwrap_err();
            assert!(e.to_string().starts_with("request 1: "), "{e}");
        }
        // the running request was untouched
        assert_eq!((s.running(), s.queued()), (1, 0));
        let mut done = Vec::new();
        while !s.is_idle() {
            done.extend(s.step(&mut d).unwrap());
        }
        assert_eq!((done[0].id, done[0].tokens.len()), (kept, 4));
    });
}

/// Partial rollouts: an update lands mid-generation (every running request preempted, the
/// version moved); each token records the version it was sampled on, a request continued on
/// the same weights samples exactly what it would have without the preemption, and one past
/// `max_staleness` versions is dropped and counted.
#[test]
fn partial_rollouts_record_versions_and_stale_samples_are_dropped() {
    let reqs: Vec<Request> = (0..6u64)
        .map(|i| {
            Request::new(
                vec![1 + i as u32, 2, 3],
                SamplingParams::new(12).with_temperature(1.0).with_seed(i),
            )
        })
        .collect();
    let uninterrupted = run(3, reqs.clone());
    with_decoder(|d| {
        let mut d = d.with_slots(3, 64);
        let mut s = Scheduler::new();
        for r in &reqs {
            s.submit(&d, r.clone()).unwrap();
        }
        let mut done = Vec::new();
        for _ in 0..4 {
            done.extend(s.step(&mut d).unwrap());
        }
        // the update: KV of version 0 dropped, sampling goes on on version 1
        assert!(s.set_version(1).is_err(), "refused while requests hold KV");
        s.preempt_all();
        assert_eq!((s.running(), s.queued()), (0, 6));
        s.set_version(1).unwrap();
        while !s.is_idle() {
            done.extend(s.step(&mut d).unwrap());
        }
        done.sort_by_key(|x| x.id);
        for (a, b) in done.iter().zip(&uninterrupted) {
            assert_eq!(a.tokens, b.tokens, "request {}", a.id);
            assert_eq!(a.logprobs, b.logprobs, "request {}", a.id);
        }
        // the first three ran 5 tokens on version 0 (a prefill and 4 decodes), then version 1
        for x in &done[..3] {
            assert_eq!(x.versions[..5], [0; 5]);
            assert!(x.versions[5..].iter().all(|&v| v == 1));
        }
        // the last three waited for slots: all on version 1
        for x in &done[3..] {
            assert!(x.versions.iter().all(|&v| v == 1), "{:?}", x.versions);
        }
        // staleness: two requests preempted at version 1, the version moves to 3
        let mut s = Scheduler::new();
        for r in &reqs[..2] {
            s.submit(&d, r.clone()).unwrap();
        }
        s.set_version(1).unwrap();
        s.step(&mut d).unwrap();
        s.preempt_all();
        s.set_version(2).unwrap();
        assert!(
            s.drop_stale(1).is_empty(),
            "one version behind is within the bound"
        );
        s.set_version(3).unwrap();
        let dropped = s.drop_stale(1);
        assert_eq!(dropped.len(), 2);
        assert!(dropped
            .iter()
            .all(|x| x.finish == FinishReason::Abort && x.versions[0] == 1));
        assert!(s.is_idle());
    });
}

/// Streamed dynamic sampling on the CPU decoder: groups of 4 with long-tailed lengths, a coin
/// per group that ignores length; abort mode stops at the wanted count and frees the rest,
/// partial mode carries the in-flight requests into the next fill on the next weight version.
#[test]
fn streamed_dynamic_sampling_keeps_the_wanted_groups() {
    use lifecycle_decoder::{GroupStream, Leftovers, SplitMix64};
    let group = |g: u64| -> Result<Vec<Request>, DecodeError> {
        Ok((0..4u64)
            .map(|j| {
                let len = [2, 3, 5, 8, 13, 30][((g * 4 + j) % 6) as usize];
                Request::new(
                    vec![1 + (g % 40) as u32, 2],
                    SamplingParams::new(len)
                        .with_temperature(1.0)
                        .with_seed(g * 4 + j),
                )
            })
            .collect())
    };
    let coin = |g: u64, _: &[Sample]| Ok(SplitMix64::from_keys(&[99, g]).next_f32() < 0.5);
    with_decoder(|d| {
        let mut d = d.with_slots(6, 64);
        let mut abort = GroupStream::new(4, Leftovers::Abort);
        let f = abort.fill(&mut d, 3, group, coin).unwrap();
        assert_eq!(f.kept.len(), 3);
        assert!(f.kept.iter().all(|g| g.len() == 4));
        assert!(f.aborted > 0, "the tail is aborted");
        assert!(abort.scheduler().is_idle());
        println!(
            "abort: kept mean {:.1} tokens, finished mean {:.1}, {} aborted",
            f.kept_mean_len(),
            f.finished_mean_len(),
            f.aborted
        );
        let mut partial = GroupStream::new(4, Leftovers::Partial { max_staleness: 1 });
        let first = partial.fill(&mut d, 3, group, coin).unwrap();
        assert!(first.carried > 0 && first.aborted == 0);
        partial.set_version(1).unwrap();
        let second = partial.fill(&mut d, 3, group, coin).unwrap();
        assert_eq!(second.kept.len(), 3);
        let spans = second
            .kept
            .iter()
            .flatten()
            .any(|s| s.versions.first() == Some(&0) && s.versions.last() == Some(&1));
        let carried_kept = second
            .kept
            .iter()
            .flatten()
            .filter(|s| s.versions[0] == 0)
            .count();
        println!(
            "partial: {} carried, {carried_kept} kept samples began on version 0",
            first.carried
        );
        assert!(spans || carried_kept == 0);
        // two versions later whatever began on version 0 is stale
        partial.set_version(3).unwrap();
        let third = partial.fill(&mut d, 1, group, coin).unwrap();
        assert!(third.kept.iter().flatten().all(|s| s.versions[0] >= 2));
        assert!(third.stale > 0 || second.carried == 0);
    });
}

/// A fill whose groups are never kept ends at its bound of groups, with none kept.
#[test]
fn a_bounded_fill_ends_when_no_group_is_kept() {
    use lifecycle_decoder::{GroupStream, Leftovers};
    with_decoder(|d| {
        let mut d = d.with_slots(4, 64);
        let mut s = GroupStream::new(2, Leftovers::Abort).with_max_groups(5);
        let group = |_: u64| -> Result<Vec<Request>, DecodeError> {
            Ok(vec![Request::new(vec![1, 2], SamplingParams::new(3)); 2])
        };
        let f = s.fill(&mut d, 3, group, |_, _| Ok(false)).unwrap();
        assert!(f.kept.is_empty());
        assert_eq!(f.dropped_groups, 5);
        assert!(s.scheduler().is_idle());
    });
}
