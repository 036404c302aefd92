//! Decode throughput of the GPU decoder on bf16 and on fp8 rollout weights (W = T = 1; fp8
//! weight-only and W8A8, the latter by the decoder's defaults, with its tensor-core kernel up to
//! 64 tokens, and as before the kernel: weight streaming for one token, cuBLASLt's block-scaled
//! GEMM from two), from one
//! FSDP training state switched once per dtype, against the weight-streaming floor: a decode
//! step reads every rollout weight but the (untied) embedding once, so at small batches its time
//! is at least those bytes over the device's read rate (half the copy rate, which counts both
//! directions). With `--moe` the model is Qwen3-30B-A3B-shaped and the bf16 experts run both as
//! grouped GEMMs and one GEMM per expert; its floor counts every expert, so at small batches,
//! where a step reads only the routed experts, it is not a bound.
//!
//! ```text
//! decode_bench --layers 4 --batches 1,8,32 --new-tokens 64
//! decode_bench --moe --layers 4 --batches 1,8,32,64 --new-tokens 32
//! decode_bench --kv-dtype f32 --prompt 1024 --batches 8,32
//! ```

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use lifecycle_bench::ceilings::{device_copy, Timing};
use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy, Switching};
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{Decoder, KvDtype, ModelConfig, PrefillLogits, Sampling};
use lifecycle_decoder_gpu::{GpuDecoder, MOE_DEVICE_ROWS};
use lifecycle_fsdp::FsdpBackend;
use lifecycle_layout::fp8::{Fp8Compute, RolloutDtype};

const GB: f64 = 1e9;

/// Decode throughput, bf16 against fp8 rollout weights, on one GPU.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Decoder layers of the Qwen2.5-7B shape (hidden 3584, 28 heads / 4 kv, ffn 18944,
    /// vocabulary 152064), or of the Qwen3-30B-A3B one with --moe.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// The Qwen3-30B-A3B shape (hidden 2048, 32 heads / 4 kv of 128, 128 experts of 768,
    /// top-8, vocabulary 151936): grouped and per-expert bf16 experts, and fp8.
    #[arg(long)]
    moe: bool,
    /// Batch sizes (sequences decoded together), comma-separated.
    #[arg(long, default_value = "1,8,32", value_delimiter = ',')]
    batches: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 32)]
    prompt: usize,
    /// Tokens generated per sequence (greedy, on the device).
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// The KV cache's element type: bf16 (as an engine keeps it; the default) or f32 (the
    /// decoder's exact mode).
    #[arg(long, default_value = "bf16", value_parser = <KvDtype as std::str::FromStr>::from_str)]
    kv_dtype: KvDtype,
    /// Decode steps replayed from CUDA graphs (`on`, the decoder's default), queued eagerly
    /// (`off`), or every variant both ways (`both`).
    #[arg(long, value_enum, default_value_t = Graphs::On)]
    graphs: Graphs,
    /// Run only the variants of these names (separated by `;`, as the output names them: `bf16`,
    /// `fp8 weight-only`, `W8A8 default`, ...; the ratios need `bf16`); all when not given.
    #[arg(long, value_delimiter = ';')]
    only: Vec<String>,
    /// Timed runs of each batch's prefill and generation (after a warm-up); the fastest of
    /// each is reported (the least disturbed by what else the device and the host did).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    repeats: u64,
    /// After each batch's timings, one more decode step between `cuProfilerStart` and
    /// `cuProfilerStop`, for `ncu --profile-from-start off` to profile it alone.
    #[arg(long)]
    profile: bool,
}

/// Starts (`true`) or stops the profiler's collection on every rank of `pool`.
fn profiler(pool: &ThreadRankPool, start: bool) -> Result<(), Box<dyn Error>> {
    use lifecycle_cuda::cudarc::driver::sys;
    use lifecycle_cuda::{CudaError, RankExecutor};
    let mut ranks = vec![(); pool.local_ranks().len()];
    pool.run_each(&mut ranks, &|ctx, _| {
        let what = if start {
            "starting the profiler"
        } else {
            "stopping the profiler"
        };
        ctx.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver(ctx.rank, what, 0, e))?;
        // SAFETY: no arguments; the rank's context is current on this thread.
        let r = unsafe {
            if start {
                sys::cuProfilerStart()
            } else {
                sys::cuProfilerStop()
            }
        };
        r.result()
            .map_err(|e| CudaError::driver(ctx.rank, what, 0, e))
    })?;
    Ok(())
}

/// Which decode steps `--graphs` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Graphs {
    On,
    Off,
    Both,
}

fn config(layers: usize, moe: bool) -> Result<ModelConfig, Box<dyn Error>> {
    if moe {
        return Ok(ModelConfig::from_json_str(&format!(
            r#"{{"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                "intermediate_size": 6144, "num_hidden_layers": {layers},
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": true}}"#
        ))?);
    }
    Ok(ModelConfig::from_json_str(&format!(
        r#"{{"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": {layers},
            "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false}}"#
    ))?)
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    if args.new_tokens < 2 || args.batches.is_empty() {
        return Err("--new-tokens must be at least 2 and --batches not empty".into());
    }
    let config = config(args.layers, args.moe)?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let copy = device_copy(&*pool, 1 << 30, Timing::after_idle(1, 5))?;
    println!(
        "{} shape, {} layers, {} KV cache; device copy rate {:.0} GB/s (read + write)",
        if args.moe {
            "Qwen3-30B-A3B"
        } else {
            "Qwen2.5-7B"
        },
        args.layers,
        args.kv_dtype,
        copy / GB
    );
    // the MoE shape runs its bf16 experts routed on the device (decode steps of up to
    // MOE_DEVICE_ROWS sequences), routed on the host in blocks of batched GEMMs, and one GEMM per
    // expert; fp8 runs weight-only, then W8A8 by the decoder's defaults, with the warpgroup
    // kernel (where loaded) from one token, and with the mma.sync kernel up to 8 tokens and the
    // warpgroup kernel up to 32 (cuBLASLt beyond: the default before its row blocks past the
    // resident ones split)
    let bf16 = Variant {
        dtype: RolloutDtype::Bf16,
        grouped: true,
        compute: Fp8Compute::WeightOnly,
        limits: None,
        device: true,
        graphs: args.graphs != Graphs::Off,
    };
    let mut variants = vec![bf16];
    if args.moe {
        variants.push(Variant {
            device: false,
            ..bf16
        });
        variants.push(Variant {
            grouped: false,
            device: false,
            ..bf16
        });
    }
    let fp8 = Variant {
        dtype: RolloutDtype::Fp8,
        ..bf16
    };
    let w8a8 = Variant {
        compute: Fp8Compute::W8A8,
        ..fp8
    };
    variants.extend([
        fp8,
        w8a8,
        Variant {
            limits: Some((0, 0, 64)),
            ..w8a8
        },
        Variant {
            limits: Some((0, 8, 32)),
            ..w8a8
        },
    ]);
    if !args.only.is_empty() {
        let known: Vec<String> = variants.iter().map(Variant::name).collect();
        if let Some(bad) = args.only.iter().find(|o| !known.contains(o)) {
            return Err(format!("--only {bad:?}: no such variant (there are {known:?})").into());
        }
        variants.retain(|v| args.only.contains(&v.name()));
    }
    if args.graphs == Graphs::Both {
        // each variant eager, then graphed
        variants = variants
            .into_iter()
            .flat_map(|v| {
                [
                    Variant { graphs: false, ..v },
                    Variant { graphs: true, ..v },
                ]
            })
            .collect();
    }
    let shapes = config.tensor_shapes();
    let mut state = FsdpBackend::new(pool.clone(), config.rollout_layout(1)?)
        .synthetic_state(&shapes, 7, 0.02)?;
    // (variant, batch, decode tokens/s, prefill seconds)
    let mut rates: Vec<(usize, usize, f64, f64)> = Vec::new();
    for (vi, v) in variants.iter().enumerate() {
        let Variant {
            dtype,
            grouped,
            compute,
            limits,
            device,
            graphs,
        } = *v;
        let backend =
            FsdpBackend::new(pool.clone(), config.rollout_layout(1)?).with_rollout_dtype(dtype);
        let lc_config = LifecycleConfig {
            switching: Switching::Lazy,
            memory: MemoryPolicy::resident(),
        };
        let mut lc = Lifecycle::with_config(backend, state, lc_config)?;
        {
            let session = lc.rollout()?;
            let weights = session.weights();
            let held: u64 = weights.get().entries().iter().map(|e| e.bytes()).sum();
            // a decode step streams every weight but the embedding (whose rows it gathers)
            // once: at the read half of the copy rate
            let embed = weights
                .get()
                .entries()
                .iter()
                .find(|e| e.name() == "model.embed_tokens.weight")
                .map_or(0, |e| e.bytes());
            let floor = (held - embed) as f64 / (copy / 2.0);
            let mut dec = GpuDecoder::new(&config, session.backend(), weights.get())?;
            dec.set_kv_dtype(args.kv_dtype)?;
            dec.set_step_graphs(graphs);
            let grouped = dec.set_grouped_experts(grouped);
            let device = dec.set_device_routing(device);
            let how = match (args.moe, grouped, device, dtype) {
                (false, ..) => "",
                (true, true, true, RolloutDtype::Fp8) if compute == Fp8Compute::W8A8 => &*format!(
                    ", fp8 experts routed on the device (in chunks of {MOE_DEVICE_ROWS} \
                         rows beyond them)"
                ),
                (true, true, true, RolloutDtype::Fp8) => &*format!(
                    ", fp8 experts routed on the device (up to {MOE_DEVICE_ROWS} sequences)"
                ),
                (true, _, _, RolloutDtype::Fp8) => ", fp8 experts",
                (true, true, true, _) => &*format!(
                    ", experts routed on the device up to {MOE_DEVICE_ROWS} sequences (weight \
                     streaming over the routing's table), else in blocks of batched GEMMs"
                ),
                (true, true, false, _) => {
                    ", experts routed on the host in blocks of one batched GEMM per product"
                }
                (true, false, ..) => ", one GEMM per expert, routed on the host",
            };
            let compute_how = match (dtype, compute) {
                (RolloutDtype::Bf16, _) => String::new(),
                (_, Fp8Compute::WeightOnly) => " weight-only".to_string(),
                (_, Fp8Compute::W8A8) => {
                    dec.set_fp8_compute(compute)?;
                    if let Some((gemv, mma, wgmma)) = limits {
                        dec.set_fp8_gemv_tokens(gemv);
                        dec.set_fp8_mma_tokens(mma);
                        dec.set_fp8_wgmma_tokens(wgmma);
                    }
                    format!(" W8A8 ({})", v.name())
                }
            };
            let graphs_how = if graphs {
                ", steps replayed from CUDA graphs"
            } else {
                ", steps queued eagerly"
            };
            println!(
                "\n{dtype}{compute_how}{how}{graphs_how}: rollout weights {:.3} GB ({:.3} GB streamed per step); floor {:.3} ms per step",
                held as f64 / GB,
                (held - embed) as f64 / GB,
                floor * 1e3
            );
            for &batch in &args.batches {
                let prompts: Vec<Vec<u32>> = (0..batch)
                    .map(|i| {
                        (0..args.prompt)
                            .map(|j| ((i * 7919 + j * 104729) % config.model.vocab) as u32)
                            .collect()
                    })
                    .collect();
                // warm-up, then the prefill alone (one token) and the whole generation
                dec.generate(&prompts, &Sampling::greedy(4))?;
                // each timed with the host's waits for the device in it: the rest is the time
                // the host took to queue the work
                let waited = |dec: &GpuDecoder<'_>| dec.host_wait_time().as_secs_f64();
                let fastest = |a: (f64, f64), b: (f64, f64)| if b.0 < a.0 { b } else { a };
                let (mut pre, mut all) = ((f64::INFINITY, 0.0), (f64::INFINITY, 0.0));
                for _ in 0..args.repeats {
                    let (t, w0) = (Instant::now(), waited(&dec));
                    dec.generate(&prompts, &Sampling::greedy(1))?;
                    pre = fastest(pre, (t.elapsed().as_secs_f64(), waited(&dec) - w0));
                    let (t, w0) = (Instant::now(), waited(&dec));
                    dec.generate(&prompts, &Sampling::greedy(args.new_tokens))?;
                    all = fastest(all, (t.elapsed().as_secs_f64(), waited(&dec) - w0));
                }
                let ((prefill, prefill_wait), (total, total_wait)) = (pre, all);
                // the host waits of one decode step beyond the one for its logits
                dec.prefill(&prompts, PrefillLogits::Last)?;
                let feed: Vec<u32> = prompts.iter().map(|p| p[0]).collect();
                let waits = dec.host_waits();
                dec.decode_step(&feed)?;
                let waits_per_step = dec.host_waits() - waits - 1;
                let step = (total - prefill).max(1e-9) / (args.new_tokens - 1) as f64;
                let queued = ((total - total_wait) - (prefill - prefill_wait)).max(0.0)
                    / (args.new_tokens - 1) as f64;
                let rate = batch as f64 / step;
                println!(
                    "  batch {batch:>3}: prefill {:.2} ms, decode {:.3} ms/step ({:.2}x the \
                     floor; the host queues it in {:.3} ms), {rate:.0} tokens/s; host waits in \
                     a decode step beyond its logits': {waits_per_step}",
                    prefill * 1e3,
                    step * 1e3,
                    step / floor,
                    queued * 1e3
                );
                rates.push((vi, batch, rate, prefill));
                if args.profile {
                    dec.decode_step(&feed)?;
                    profiler(&pool, true)?;
                    dec.decode_step(&feed)?;
                    profiler(&pool, false)?;
                }
            }
            if graphs {
                let (captured, replayed) = dec.step_graphs();
                println!("  {captured} graphs captured, {replayed} decode steps replayed");
            }
        }
        state = lc.into_parts()?.1;
    }
    println!("\nagainst bf16 (grouped experts) with the same graphs setting, decode tokens/s and prefill time:");
    let of = |v: &Variant, batch: usize| {
        let vi = variants.iter().position(|w| w == v)?;
        rates.iter().find(|r| r.0 == vi && r.1 == batch)
    };
    for &batch in &args.batches {
        for graphs in [false, true] {
            let base = Variant { graphs, ..bf16 };
            let Some(&(_, _, b, bp)) = of(&base, batch) else {
                continue;
            };
            let mode = if graphs { "graphs" } else { "eager" };
            let mut line = format!("  batch {batch:>3} ({mode}): bf16 {b:.0} tokens/s");
            for v in variants
                .iter()
                .filter(|v| v.graphs == graphs && **v != base)
            {
                let Some(&(_, _, r, p)) = of(v, batch) else {
                    continue;
                };
                let name = v.name();
                line += &format!(
                    "; {name} {:.2}x (prefill {:.2}x)",
                    r / b.max(1e-9),
                    bp / p.max(1e-12)
                );
            }
            println!("{line}");
        }
    }
    if args.graphs == Graphs::Both {
        println!("\ngraphs against eager steps, decode tokens/s:");
        for &batch in &args.batches {
            let mut line = format!("  batch {batch:>3}:");
            for v in variants.iter().filter(|v| v.graphs) {
                let eager = Variant {
                    graphs: false,
                    ..*v
                };
                if let (Some(g), Some(e)) = (of(v, batch), of(&eager, batch)) {
                    line += &format!(" {} {:.2}x;", v.name(), g.2 / e.2.max(1e-9));
                }
            }
            println!("{line}");
        }
    }
    Ok(())
}

/// One way of decoding the model.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Variant {
    dtype: RolloutDtype,
    /// bf16 experts in blocks of batched GEMMs (else one GEMM per expert).
    grouped: bool,
    compute: Fp8Compute,
    /// W8A8: the tokens up to which the weight-streaming kernel, then the `mma.sync` kernel,
    /// then the warpgroup kernel run (`None`: the decoder's defaults).
    limits: Option<(usize, usize, usize)>,
    /// MoE routed on the device.
    device: bool,
    /// Decode steps replayed from CUDA graphs.
    graphs: bool,
}

impl Variant {
    fn name(&self) -> String {
        match (self.dtype, self.compute, self.limits) {
            (RolloutDtype::Bf16, ..) if !self.grouped => "bf16 per expert".into(),
            (RolloutDtype::Bf16, ..) if !self.device => "bf16 routed on the host".into(),
            (RolloutDtype::Bf16, ..) => "bf16".into(),
            (_, Fp8Compute::WeightOnly, _) => "fp8 weight-only".into(),
            (_, Fp8Compute::W8A8, None) => "W8A8 default".into(),
            (_, Fp8Compute::W8A8, Some((g, m, w))) => {
                let mut parts = Vec::new();
                if g > 0 {
                    parts.push(format!("streaming to {g}"));
                }
                if m > 0 {
                    parts.push(format!("mma.sync to {m}"));
                }
                if w > 0 {
                    parts.push(format!("wgmma to {w}"));
                }
                parts.push("then cuBLASLt".into());
                format!("W8A8 {}", parts.join(", "))
            }
        }
    }
}
