//! GPU tests of continuous batching and the device pick (`GpuEngine::run`): against the CPU
//! decoder under the same scheduler (tokens, finish reasons, log-probabilities) on the fixture
//! checkpoints with an f32 KV cache, against `transformers`' log-softmax of its own logits for
//! greedy samples, and a request's samples alone vs in a crowd. Run on a machine with an NVIDIA
//! GPU:
//!
//! ```text
//! cargo test --release -p lifecycle-decoder-gpu --test continuous -- --ignored --test-threads=1 --nocapture
//! ```

use std::sync::Arc;

use lifecycle_core::Lifecycle;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{
    load_checkpoint, CpuDecoder, FinishReason, KvDtype, Request, Sample, SamplingParams, Scheduler,
};
use lifecycle_decoder_gpu::{EngineSettings, GpuEngine, KV_PAGE_POSITIONS};
use lifecycle_fsdp::FsdpBackend;
use lifecycle_host::{HostBackend, HostTrainState};
use serde_json::Value;

type Res = Result<(), Box<dyn std::error::Error>>;

mod common;

use common::{fixtures, floats, references, tokens};

const MODELS: [&str; 3] = ["gqa_untied", "tied_vocab61", "kv1_headdim16"];

fn list(v: &Value) -> Vec<Value> {
    v.as_array().cloned().unwrap_or_default()
}

/// Groups of 4 samples per fixture prompt with mixed settings: greedy, temperature, top-p,
/// top-k, stop tokens, lengths from 1 to 24.
fn requests(prompts: &[Vec<u32>], vocab: u32) -> Vec<Request> {
    let mut out = Vec::new();
    for (g, p) in prompts.iter().enumerate() {
        for j in 0..4usize {
            let n = (g * 4 + j) as u64;
            let mut s = SamplingParams::new([24, 7, 1, 16, 11][(n % 5) as usize])
                .with_temperature([1.0, 0.0, 0.7, 1.3][j])
                .with_seed(77 + n);
            if n.is_multiple_of(3) {
                s = s.with_top_p(0.8);
            }
            if n % 4 == 2 {
                s = s.with_top_k(5);
            }
            if n % 2 == 1 {
                s = s.with_stop_tokens((0..vocab).step_by(7).collect());
            }
            out.push(Request::new(p.clone(), s));
        }
    }
    out
}

/// The fixture's CPU decoder (f32 cache) under the scheduler with `slots` slots (paged as an
/// engine's cache of `pages` pages where given).
fn cpu_samples(
    name: &str,
    requests: Vec<Request>,
    (slots, positions): (usize, usize),
    pages: Option<usize>,
    mixed: bool,
) -> Vec<Sample> {
    let ckpt = load_checkpoint(&fixtures().join(name)).unwrap();
    let layout = ckpt.config.rollout_layout(1).unwrap();
    let state = HostTrainState::from_tensors(1, ckpt.tensors).unwrap();
    let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    let session = lc.rollout().unwrap();
    let w = session.weights();
    let group: Vec<_> = w.ranks.iter().collect();
    let mut cpu = CpuDecoder::new(&ckpt.config, &layout, &group)
        .unwrap()
        .with_slots(slots, positions);
    if let Some(pages) = pages {
        cpu = cpu.with_kv_pages(pages, KV_PAGE_POSITIONS);
    }
    Scheduler::new()
        .with_mixed_steps(mixed)
        .run(&mut cpu, requests)
        .unwrap()
}

/// The GPU engine's samples of `requests` on the fixture `name` (FSDP lifecycle at W = 1).
fn gpu_samples(
    name: &str,
    requests: Vec<Request>,
    settings: EngineSettings,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    gpu_samples_with(name, requests, settings, Scheduler::new())
}

/// [`gpu_samples`] under `scheduler`.
fn gpu_samples_with(
    name: &str,
    requests: Vec<Request>,
    settings: EngineSettings,
    mut scheduler: Scheduler,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    let ckpt = load_checkpoint(&fixtures().join(name))?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let backend = FsdpBackend::new(pool, ckpt.config.rollout_layout(1)?);
    let state = backend.state_from_tensors(ckpt.tensors)?;
    let engine = GpuEngine::for_backend(&backend, &ckpt.config, settings)?;
    let mut lc = Lifecycle::new(backend, state).with_engine(engine);
    let mut session = lc.rollout()?;
    let (weights, mut engine) = session.parts();
    let out = {
        let mut slots = engine.slots(&weights)?;
        scheduler.run(&mut slots, requests)?
    };
    session.finish()?;
    Ok(out)
}

/// Every fixture model, an f32 cache, 5 slots for 12–16 requests (so finished samples free
/// slots that queued ones take), prefix sharing on, admissions prefilled in passes of their
/// own and in the passes that feed the running requests (mixed steps); then the prompts tiled to
/// 150 tokens in a cache of 6 pages for 8 slots, so that a group of 4 samples (3 pages for the
/// first, 1 of its own for each other beside the 2 full pages they share) fills it and the
/// next group waits for pages: the GPU's tokens and finish reasons equal the CPU decoder's
/// under the same scheduler (the CPU paged alike), and its log-probabilities (at the request's
/// temperature, at T = 1, truncated) within 1e-3 of the CPU's on the same tokens.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn continuous_engine_matches_the_cpu_decoder_under_the_same_scheduler() -> Res {
    require_gpus(1)?;
    let refs = references()?;
    let mut failures = Vec::new();
    let runs = MODELS.iter().flat_map(|&n| {
        [
            (n, false, false),
            (n, true, false),
            (n, false, true),
            (n, true, true),
        ]
    });
    for (name, mixed, long) in runs {
        let cases = list(&refs["models"][name]["cases"]);
        let mut prompts: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["prompt"])).collect();
        let vocab = load_checkpoint(&fixtures().join(name))?.config.model.vocab as u32;
        let (room, pages) = if long {
            for p in &mut prompts {
                *p = p.iter().copied().cycle().take(150).collect();
            }
            ((8, 200), Some(6))
        } else {
            ((5, 40), None)
        };
        let reqs = requests(&prompts, vocab);
        let mut settings = EngineSettings::new(room.0, room.1)
            .with_kv_dtype(KvDtype::F32)
            .with_fork_prefill(true);
        if let Some(pages) = pages {
            settings = settings.with_kv_tokens(pages * KV_PAGE_POSITIONS);
        }
        let scheduler = Scheduler::new().with_mixed_steps(mixed);
        let gpu = gpu_samples_with(name, reqs.clone(), settings, scheduler)?;
        let cpu = cpu_samples(name, reqs.clone(), room, pages, mixed);
        let (mut worst, mut tokens_compared, mut finishes) = (0.0f32, 0, [0usize; 3]);
        for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
            finishes[g.finish as usize] += 1;
            if g.tokens != c.tokens || g.finish != c.finish {
                failures.push(format!(
                    "{name} request {i} ({:?}): GPU {:?} {} vs CPU {:?} {}",
                    reqs[i].params, g.tokens, g.finish, c.tokens, c.finish
                ));
                continue;
            }
            for (a, b) in [
                (&g.logprobs, &c.logprobs),
                (&g.raw_logprobs, &c.raw_logprobs),
                (&g.truncated_logprobs, &c.truncated_logprobs),
            ] {
                for (x, y) in a.iter().zip(b.iter()) {
                    worst = worst.max((x - y).abs());
                }
            }
            tokens_compared += g.tokens.len();
        }
        println!(
            "{name}{}{}: {} requests, {tokens_compared} tokens equal; finishes stop/length/abort \
             {finishes:?}; max |Δ logprob| vs the CPU decoder {worst:.2e}",
            if mixed { " (mixed steps)" } else { "" },
            if long {
                " (150-token prompts, 6 pages)"
            } else {
                ""
            },
            reqs.len()
        );
        if worst > 1e-3 {
            failures.push(format!("{name}: max |Δ logprob| {worst} > 1e-3"));
        }
        if finishes[FinishReason::Stop as usize] == 0 {
            failures.push(format!("{name}: no request stopped at a stop token"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Greedy samples of the fixture prompts: the tokens are transformers' greedy tokens and each
/// token's log-probability is `log_softmax` of transformers' own logits at that position within
/// 1e-3 (f32 cache).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn greedy_log_probs_match_transformers_log_softmax() -> Res {
    require_gpus(1)?;
    let refs = references()?;
    let mut failures = Vec::new();
    for name in MODELS {
        let cases = list(&refs["models"][name]["cases"]);
        let reqs: Vec<Request> = cases
            .iter()
            .map(|c| {
                let n = list(&c["greedy_tokens"]).len();
                Request::new(tokens(&c["prompt"]), SamplingParams::new(n))
            })
            .collect();
        let settings = EngineSettings::new(8, 32).with_kv_dtype(KvDtype::F32);
        let got = gpu_samples(name, reqs, settings)?;
        let mut worst = 0.0f64;
        for (i, (s, c)) in got.iter().zip(&cases).enumerate() {
            let greedy = tokens(&c["greedy_tokens"]);
            if s.tokens != greedy {
                failures.push(format!("{name} case {i}: {:?} != {greedy:?}", s.tokens));
                continue;
            }
            let prefill = list(&c["prefill_logits"]);
            let mut rows = vec![floats(&prefill[prefill.len() - 1])];
            rows.extend(list(&c["decode_logits"]).iter().map(floats));
            for (k, &t) in greedy.iter().enumerate() {
                let row = &rows[k];
                let top = row.iter().fold(f32::MIN, |m, &v| m.max(v)) as f64;
                let lse = top
                    + row
                        .iter()
                        .map(|&v| (v as f64 - top).exp())
                        .sum::<f64>()
                        .ln();
                let want = row[t as usize] as f64 - lse;
                worst = worst.max((f64::from(s.logprobs[k]) - want).abs());
                worst = worst.max((f64::from(s.raw_logprobs[k]) - want).abs());
            }
        }
        println!("{name}: greedy log-probs vs transformers' log_softmax: max |Δ| {worst:.2e}");
        if worst > 1e-3 {
            failures.push(format!("{name}: max |Δ logprob| {worst} > 1e-3"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// A request's sample alone (one slot) and among 15 others (4 slots, bf16 cache, the engine's
/// defaults otherwise): its draws are its own, so its tokens are the same given equal logits;
/// the count of requests whose tokens differ is printed (GEMMs over other row counts may round
/// differently), and every sample's finish reason is consistent with its tokens.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_request_alone_and_in_a_crowd() -> Res {
    require_gpus(1)?;
    let name = "gqa_untied";
    let refs = references()?;
    let cases = list(&refs["models"][name]["cases"]);
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| tokens(&c["prompt"])).collect();
    let vocab = load_checkpoint(&fixtures().join(name))?.config.model.vocab as u32;
    let reqs = requests(&prompts, vocab);
    let crowd = gpu_samples(name, reqs.clone(), EngineSettings::new(4, 40))?;
    let mut differ = 0;
    for (i, r) in reqs.iter().enumerate() {
        let alone = gpu_samples(name, vec![r.clone()], EngineSettings::new(1, 40))?.remove(0);
        if alone.tokens != crowd[i].tokens {
            differ += 1;
        }
        let s = &crowd[i];
        match s.finish {
            FinishReason::Stop => assert!(r.params.stops_at(*s.tokens.last().ok_or("empty")?)),
            FinishReason::Length => assert_eq!(s.tokens.len(), r.params.max_new_tokens),
            FinishReason::Abort => return Err("nothing was aborted".into()),
        }
    }
    println!(
        "{} requests: {differ} sampled other tokens alone than in a crowd",
        reqs.len()
    );
    Ok(())
}

/// Contexts past the old 8192-position limit: a 12 000-token prompt and 6 greedy tokens on an
/// engine of 12 008 positions (its attention launches past the default 48 KiB of shared
/// memory), against the CPU decoder (f32 caches): the same tokens, log-probs within 1e-3; an
/// engine asking for more positions than the kernels hold is refused at construction.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn contexts_past_8k_positions_match_the_cpu_decoder() -> Res {
    require_gpus(1)?;
    let name = "gqa_untied";
    let vocab = load_checkpoint(&fixtures().join(name))?.config.model.vocab as u32;
    let prompt: Vec<u32> = (0..12_000u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let req = vec![Request::new(prompt, SamplingParams::new(6))];
    let settings = EngineSettings::new(1, 12_008).with_kv_dtype(KvDtype::F32);
    let gpu = gpu_samples(name, req.clone(), settings)?;
    let cpu = cpu_samples(name, req, (1, 12_008), None, false);
    let worst = gpu[0]
        .logprobs
        .iter()
        .zip(&cpu[0].logprobs)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    println!(
        "12 000-token prompt: GPU {:?} vs CPU {:?}; max |Δ logprob| {worst:.2e}",
        gpu[0].tokens, cpu[0].tokens
    );
    assert_eq!(gpu[0].tokens, cpu[0].tokens);
    assert!(worst <= 1e-3, "{worst}");
    let too_long = EngineSettings::new(1, lifecycle_decoder_gpu::MAX_CONTEXT + 1);
    assert!(gpu_samples(name, vec![], too_long).is_err());
    Ok(())
}
