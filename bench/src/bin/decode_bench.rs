//! Decode throughput of the GPU decoder on bf16 and on fp8 rollout weights (W = T = 1; fp8
//! weight-only and W8A8, the latter by the decoder's defaults, with its tensor-core kernel up to
//! 64 tokens, and as before the kernel: weight streaming for one token, cuBLASLt's block-scaled
//! GEMM from two), from one FSDP training state switched once per dtype, against a floor per
//! decode step from two rates measured in the same process, the larger of two bounds:
//!
//! - memory: the bytes a step must read over the device's read rate. A step reads every rollout
//!   weight but the (untied) embedding, whose rows it gathers, once, and every sequence's KV
//!   cache at the timed steps' mean context (the prompt and half the new tokens). The read rate
//!   is a read-only kernel's (`kernels/read_probe.cu`: 16-byte loads over a 4 GiB buffer, read 4
//!   times a run, one word written per block; the fastest of 5 runs and of a few grids), not half
//!   the device copy rate: a step only reads, and a read-only stream runs at about the whole copy
//!   rate, so half of it made the floor about twice too low.
//! - compute: the step's FLOPs over the tensor cores' rate. Per sequence, 2 per weight of the
//!   products it goes through (not the embedding, whose rows are gathered; of a mixture of
//!   experts, only its top-k experts) and attention's `4 · heads · head_dim · context` per
//!   layer. The rate is a cuBLAS bf16 GEMM's (8192³, bf16 in and out, f32 accumulation; the
//!   fastest of 5 runs of 8), taken twice for W8A8's fp8 products (Hopper's dense fp8 peak is
//!   twice its bf16 one; that rate is not measured).
//!
//! Each batch's line gives the step's time over its floor and which bound binds. With `--moe`
//! the model is Qwen3-30B-A3B-shaped and the bf16 experts run both as grouped GEMMs and one GEMM
//! per expert; its memory bound counts every expert, so at small batches, where a step reads
//! only the routed experts, it is not a bound.
//!
//! ```text
//! decode_bench --layers 4 --batches 1,8,32 --new-tokens 64
//! decode_bench --moe --layers 4 --batches 1,8,32,64 --new-tokens 32
//! decode_bench --kv-dtype f32 --prompt 1024 --batches 8,32
//! ```

use lifecycle_layout::settings::Configure;
use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use half::bf16;
use lifecycle_bench::ceilings::{device_copy, Timing};
use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy, Switching};
use lifecycle_cuda::cudarc::cublas::result::CublasError;
use lifecycle_cuda::cudarc::cublas::{sys as cublas_sys, CudaBlas, Gemm, GemmConfig};
use lifecycle_cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use lifecycle_cuda::{alloc_zeros, CudaError, KernelSet, RankCtx, RankExecutor, ThreadRankPool};
use lifecycle_decoder::{Decoder, KvDtype, ModelConfig, PrefillLogits, Sampling};
use lifecycle_decoder_gpu::{GpuDecoder, LoraMode, MOE_DEVICE_ROWS};
use lifecycle_fsdp::FsdpBackend;
use lifecycle_layout::fp8::{Fp8Compute, RolloutDtype};
use lifecycle_layout::hf;
use lifecycle_layout::lora::{with_adapters, LoraConfig, LoraTarget};

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
    /// With r > 0, also `bf16 LoRA`: the bf16 model with LoRA adapters of rank r on all seven
    /// linear types (`lora_alpha` 2r), applied unmerged by the engine, and `bf16 LoRA merged`,
    /// merged into a private copy (its merge time printed), and `bf16 LoRA riders`, unmerged
    /// with the `A` products riding their base products' launch
    /// (`GpuDecoder::set_lora_riders`), against `bf16` (the same shapes).
    #[arg(long, default_value_t = 0)]
    lora: usize,
    /// With `--lora`, the rows from which the unmerged adapters' `A` products run on tensor
    /// cores (`GpuDecoder::set_lora_tile_rows`); the decoder's default where not given.
    #[arg(long)]
    lora_tiles_from: Option<usize>,
    /// The tokens up to which a bf16 product runs the decoder's tensor-core kernel
    /// (`GpuDecoder::set_bf16_mma_tokens`, at most 32; the variant `bf16 cuBLAS` none): where
    /// LoRA's `A` products may ride (`bf16 LoRA riders`). The decoder's default where not given.
    #[arg(long)]
    bf16_mma_tokens: Option<usize>,
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
    Ok(lifecycle_bench::models::qwen25_7b(layers)?)
}

/// The read-only probe's kernel ([`read_rate`]).
const READ_PROBE: KernelSet = KernelSet::new(
    "decode_bench read probe",
    include_str!("../../../kernels/read_probe.cu"),
);
/// Bytes of the read probe's buffer: 4 GiB, far beyond any cache.
const READ_BYTES: usize = 4 << 30;
/// Passes over the read probe's buffer in one timed run.
const READ_PASSES: usize = 4;
/// Threads per block of the read probe (the kernel takes at most 256).
const READ_BLOCK: u32 = 256;
/// Rows, columns and inner size of the GEMM the tensor-core rate is timed on.
const GEMM_N: usize = 8192;
/// What the tensor-core probe says when cuBLAS cannot be loaded.
const NO_CUBLAS: &str = "the cuBLAS library (libcublas.so) could not be loaded: install the \
    CUDA toolkit's cuBLAS (or the pip wheel nvidia-cublas) and put its folder on LD_LIBRARY_PATH";
/// GEMMs in one timed run of the tensor-core probe.
const GEMMS_PER_RUN: usize = 8;
/// Timed runs of each probe, after one untimed run; the fastest counts.
const PROBE_RUNS: usize = 5;

/// The device's rates the floor divides by, measured in this process (the slowest rank's).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rates {
    /// Bytes per second a read-only kernel reads ([`read_rate`]).
    read: f64,
    /// FLOPs per second of a cuBLAS bf16 GEMM ([`tensor_rate`]).
    tensor: f64,
}

/// The fastest of [`PROBE_RUNS`] timed runs of `run` (which must wait for the work it queues),
/// after one untimed run, in seconds.
fn fastest_secs(mut run: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    run()?;
    let mut best = f64::INFINITY;
    for _ in 0..PROBE_RUNS {
        let t = Instant::now();
        run()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The read rate (bytes per second) of a read-only kernel (`kernels/read_probe.cu`) passing
/// [`READ_PASSES`] times over a [`READ_BYTES`] buffer on each rank's compute stream, writing one
/// word per block: the fastest run of the fastest of a few grids (a quarter, half and all of the
/// blocks an SM holds, per SM), so a launch shape that leaves bandwidth unused cannot lower it.
fn read_rate(pool: &impl RankExecutor) -> Result<f64, CudaError> {
    let rates = pool.run(&|ctx| {
        let kernel = ctx.module(&READ_PROBE)?.function("read16")?;
        let resident = kernel
            .occupancy_max_active_blocks_per_multiprocessor(READ_BLOCK, 0, None)
            .map_err(ctx.drv("reading the read probe's occupancy", 0))?
            .max(1);
        let mut per_sm = vec![(resident / 4).max(1), (resident / 2).max(1), resident];
        per_sm.dedup();
        let most = (resident * ctx.sm_count()) as usize;
        let src: CudaSlice<u8> = alloc_zeros(
            &ctx.compute,
            READ_BYTES,
            ctx.rank,
            "the read probe's buffer",
        )?;
        let mut out: CudaSlice<u32> =
            alloc_zeros(&ctx.compute, most, ctx.rank, "the read probe's block sums")?;
        let words = (READ_BYTES / 16) as u64;
        let mut best = 0.0f64;
        for blocks in per_sm {
            let cfg = LaunchConfig {
                grid_dim: (blocks * ctx.sm_count(), 1, 1),
                block_dim: (READ_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let secs = fastest_secs(|| {
                for _ in 0..READ_PASSES {
                    let mut b = ctx.compute.launch_builder(&kernel);
                    b.arg(&src).arg(&words).arg(&mut out);
                    // SAFETY: `src` holds `words` 16-byte words (READ_BYTES, a multiple of 16,
                    // zeroed), which the kernel only reads; it writes one u32 per block to
                    // `out`, which holds `most` ≥ the grid's blocks; the block of READ_BLOCK
                    // threads is a multiple of 32 and at most the kernel's 256.
                    unsafe { b.launch(cfg) }
                        .map_err(ctx.drv("the read probe", READ_BYTES as u64))?;
                }
                ctx.compute
                    .synchronize()
                    .map_err(ctx.drv("waiting for the read probe", 0))
            })?;
            best = best.max((READ_BYTES * READ_PASSES) as f64 / secs);
        }
        Ok(best)
    })?;
    Ok(rates.into_iter().fold(f64::INFINITY, f64::min))
}

/// A cuBLAS failure of rank `ctx` during `op`, as the engine's error.
fn cublas_err(ctx: &RankCtx, op: &str) -> impl FnOnce(CublasError) -> CudaError + use<> {
    let (rank, op) = (ctx.rank, format!("cuBLAS {op}"));
    move |e| CudaError::Driver {
        rank,
        op,
        detail: format!("{:?}", e.0),
    }
}

/// `len` bf16 values spread over [-1, 1] (a fixed xorshift sequence), as a GEMM's operands: the
/// tensor cores run slower on varied values than on zeros.
fn operands(len: usize) -> Vec<bf16> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

/// The tensor-core rate (FLOPs per second) of a cuBLAS bf16 GEMM of [`GEMM_N`]³ (bf16 operands
/// and result, f32 accumulation) on each rank's compute stream: the fastest of [`PROBE_RUNS`]
/// runs of [`GEMMS_PER_RUN`] GEMMs.
fn tensor_rate(pool: &impl RankExecutor) -> Result<f64, Box<dyn Error>> {
    // SAFETY: only asks the dynamic loader whether the library can be opened.
    if !unsafe { cublas_sys::is_culib_present() } {
        return Err(NO_CUBLAS.into());
    }
    let host = operands(GEMM_N * GEMM_N);
    let bytes = (GEMM_N * GEMM_N * 2) as u64;
    let rates = pool.run(&|ctx| {
        let blas =
            CudaBlas::new(ctx.compute.clone()).map_err(cublas_err(ctx, "creating a handle"))?;
        let a = ctx
            .compute
            .clone_htod(&host)
            .map_err(ctx.drv("uploading the GEMM's operand", bytes))?;
        let mut c: CudaSlice<bf16> =
            alloc_zeros(&ctx.compute, GEMM_N * GEMM_N, ctx.rank, "the GEMM's result")?;
        let n = GEMM_N as i32;
        let cfg = GemmConfig {
            transa: cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            transb: cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            m: n,
            n,
            k: n,
            alpha: bf16::ONE,
            lda: n,
            ldb: n,
            beta: bf16::ZERO,
            ldc: n,
        };
        let secs = fastest_secs(|| {
            for _ in 0..GEMMS_PER_RUN {
                // SAFETY: `a` (both operands, only read) and `c` each hold GEMM_N² bf16 of the
                // handle's context, column-major with leading dimension GEMM_N as `cfg` says;
                // both live past the wait below.
                unsafe { blas.gemm(cfg, &a, &a, &mut c) }
                    .map_err(cublas_err(ctx, "GemmEx (bf16 x bf16 -> bf16)"))?;
            }
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("waiting for the GEMMs", 0))
        })?;
        Ok(2.0 * (GEMM_N as f64).powi(3) * GEMMS_PER_RUN as f64 / secs)
    })?;
    Ok(rates.into_iter().fold(f64::INFINITY, f64::min))
}

/// Both rates, then the probes' memory handed back to the driver (the model needs it).
fn rates(pool: &impl RankExecutor) -> Result<Rates, Box<dyn Error>> {
    let read = read_rate(pool)?;
    let tensor = tensor_rate(pool)?;
    pool.run(&|ctx| ctx.trim_pool())?;
    Ok(Rates { read, tensor })
}

/// Weights one sequence's decode step multiplies by, all products together: every matrix but
/// the embedding (whose rows are gathered; with tied embeddings it is the head, and counts), of
/// a mixture of experts the top-k of every layer's experts.
fn weights_per_row(config: &ModelConfig) -> f64 {
    let routed = config
        .model
        .moe
        .map_or(1.0, |m| m.top_k as f64 / m.experts as f64);
    config
        .tensor_shapes()
        .iter()
        .filter(|(_, shape)| shape.len() == 2)
        .map(|(name, shape)| {
            let n = (shape[0] * shape[1]) as f64;
            if name == hf::EMBED {
                if config.model.tied_embeddings {
                    n
                } else {
                    0.0
                }
            } else if hf::parse_expert(name).is_some() {
                n * routed
            } else {
                n
            }
        })
        .sum()
}

/// What one decode step of `batch` sequences must read and compute.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StepWork {
    /// Bytes read: the weights streamed once and every sequence's KV cache.
    bytes: f64,
    /// FLOPs of the products and of attention.
    flops: f64,
}

/// The work of a decode step of `batch` sequences at `context` cached positions each (K and V
/// in `kv`), of a model whose step streams `weight_bytes` of weights.
fn step_work(
    config: &ModelConfig,
    weight_bytes: u64,
    kv: KvDtype,
    context: f64,
    batch: usize,
) -> StepWork {
    let m = &config.model;
    let kv_bytes = (m.layers * 2 * m.query_groups * kv.head_bytes(m.head_dim)) as f64 * context;
    let attention_flops = 4.0 * (m.layers * m.heads * m.head_dim) as f64 * context;
    let rows = batch as f64;
    StepWork {
        bytes: weight_bytes as f64 + rows * kv_bytes,
        flops: rows * (2.0 * weights_per_row(config) + attention_flops),
    }
}

/// The least time a decode step can take: its two bounds, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Floor {
    /// Its bytes over the read rate.
    memory: f64,
    /// Its FLOPs over the tensor-core rate.
    compute: f64,
}

impl Floor {
    /// The floor: the larger bound.
    fn secs(self) -> f64 {
        self.memory.max(self.compute)
    }

    /// Which bound is the floor.
    fn binding(self) -> &'static str {
        if self.compute > self.memory {
            "compute"
        } else {
            "memory"
        }
    }
}

/// The floor of a step of `work` at `rates`; `fp8_products`: its products multiply fp8 by fp8
/// (W8A8), whose tensor-core rate is taken as twice the bf16 one (Hopper's dense peaks).
fn step_floor(work: StepWork, rates: Rates, fp8_products: bool) -> Floor {
    let tensor = if fp8_products {
        2.0 * rates.tensor
    } else {
        rates.tensor
    };
    Floor {
        memory: work.bytes / rates.read,
        compute: work.flops / tensor,
    }
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode_bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The benchmark. Long by design: it is the report's script, the rates first, then every
/// variant's switch and decode timings in the order the report prints them.
fn run(args: &Args) -> Result<(), Box<dyn Error>> {
    if args.new_tokens < 2 || args.batches.is_empty() {
        return Err("--new-tokens must be at least 2 and --batches not empty".into());
    }
    let config = config(args.layers, args.moe)?;
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let measured = rates(&*pool)?;
    let copy = device_copy(&*pool, 1 << 30, Timing::after_idle(1, 5))?;
    println!(
        "read rate {:.0} GB/s (read-only probe, {:.1} GB a run, the fastest of {PROBE_RUNS}), \
         tensor-core rate {:.0} TFLOP/s (cuBLAS bf16 GEMM of {GEMM_N}³, the fastest of \
         {PROBE_RUNS} runs of {GEMMS_PER_RUN}); device copy rate {:.0} GB/s (read + write, not \
         in the floor)",
        measured.read / GB,
        (READ_BYTES * READ_PASSES) as f64 / GB,
        measured.tensor / 1e12,
        copy / GB
    );
    // the timed steps attend over the prompt and 1 ..= new_tokens - 1 generated tokens
    let context = args.prompt as f64 + args.new_tokens as f64 / 2.0;
    println!(
        "{} shape, {} layers, {} KV cache, read at the timed steps' mean context of {context} \
         tokens",
        if args.moe {
            "Qwen3-30B-A3B"
        } else {
            "Qwen2.5-7B"
        },
        args.layers,
        args.kv_dtype,
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
        bf16_mma: true,
        lora: None,
        riders: false,
    };
    // bf16 with every product on cuBLAS (the decoder's tensor-core kernel off): the comparison
    let mut variants = vec![
        bf16,
        Variant {
            bf16_mma: false,
            ..bf16
        },
    ];
    // the adapters' model: its layout, configuration and training state
    let lora = (args.lora > 0)
        .then(|| {
            let cfg = LoraConfig::new(args.lora, 2.0 * args.lora as f64, LoraTarget::ALL.to_vec());
            let layout = with_adapters(&config.rollout_layout(1)?, &config.model, &cfg)?;
            let shapes: Vec<(String, Vec<usize>)> = layout
                .tensors()
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect();
            let state =
                FsdpBackend::new(pool.clone(), layout.clone()).synthetic_state(&shapes, 7, 0.02)?;
            Ok::<_, Box<dyn Error>>((cfg, layout, state))
        })
        .transpose()?;
    let (lora_cfg, lora_layout, mut lora_state) = match lora {
        Some((c, l, s)) => (Some(c), Some(l), Some(s)),
        None => (None, None, None),
    };
    if lora_cfg.is_some() {
        for mode in [LoraMode::Unmerged, LoraMode::Merged] {
            variants.push(Variant {
                lora: Some(mode),
                ..bf16
            });
        }
        // the unmerged adapters' A products riding their base products' launch
        variants.push(Variant {
            lora: Some(LoraMode::Unmerged),
            riders: true,
            ..bf16
        });
    }
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
    let mut state = Some(
        FsdpBackend::new(pool.clone(), config.rollout_layout(1)?)
            .synthetic_state(&shapes, 7, 0.02)?,
    );
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
            bf16_mma,
            lora,
            riders,
        } = *v;
        let (layout, held_state) = match (lora, &lora_layout) {
            (Some(_), Some(l)) => (l.clone(), lora_state.take()),
            _ => (config.rollout_layout(1)?, state.take()),
        };
        let held_state = held_state.ok_or("a variant's training state was not given back")?;
        let backend = FsdpBackend::new(pool.clone(), layout).with_rollout_dtype(dtype);
        let lc_config = LifecycleConfig {
            switching: Switching::Lazy,
            memory: MemoryPolicy::resident(),
        };
        let mut lc = Lifecycle::with_config(backend, held_state, lc_config)?;
        {
            let session = lc.rollout()?;
            let weights = session.weights();
            let held: u64 = weights.get().entries().iter().map(|e| e.bytes()).sum();
            // a decode step streams every weight but the embedding (whose rows it gathers) once
            let embed = weights
                .get()
                .entries()
                .iter()
                .find(|e| e.name() == hf::EMBED)
                .map_or(0, |e| e.bytes());
            let streamed = held - embed;
            let mut dec = match (lora, &lora_cfg) {
                (Some(mode), Some(c)) => {
                    GpuDecoder::new_lora_as(&config, session.backend(), weights.get(), c, mode)?
                }
                _ => GpuDecoder::new(&config, session.backend(), weights.get())?,
            };
            dec.set_kv_dtype(args.kv_dtype)?;
            dec.set_step_graphs(graphs);
            if let Some(rows) = args.lora_tiles_from {
                dec.set_lora_tile_rows(rows);
            }
            dec.set_lora_riders(riders);
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
            if !bf16_mma {
                dec.set_bf16_mma_tokens(0);
            } else if let Some(tokens) = args.bf16_mma_tokens {
                dec.set_bf16_mma_tokens(tokens);
            }
            let compute_how = match (dtype, compute) {
                (RolloutDtype::Bf16, _) if !bf16_mma => " (every product on cuBLAS)".to_string(),
                (RolloutDtype::Bf16, _) if lora == Some(LoraMode::Merged) => format!(
                    " with LoRA adapters of rank {} on all seven linear types, merged into a \
                     private copy in {:.3} ms",
                    args.lora,
                    dec.last_merge_time().as_secs_f64() * 1e3
                ),
                (RolloutDtype::Bf16, _) if lora.is_some() => format!(
                    " with LoRA adapters of rank {} on all seven linear types, unmerged{}{}",
                    args.lora,
                    args.lora_tiles_from.map_or(String::new(), |r| format!(
                        " (their A products on tensor cores from {r} rows)"
                    )),
                    if riders {
                        ", the A products riding the base products' launch"
                    } else {
                        ""
                    }
                ),
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
            let fp8_products = dtype == RolloutDtype::Fp8 && compute == Fp8Compute::W8A8;
            println!(
                "\n{dtype}{compute_how}{how}{graphs_how}: rollout weights {:.3} GB ({:.3} GB \
                 streamed per step); products at {:.0} TFLOP/s",
                held as f64 / GB,
                streamed as f64 / GB,
                measured.tensor * if fp8_products { 2e-12 } else { 1e-12 }
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
                // the decode steps of a generation: the call less its own prefill (a second
                // call's prefill differs from it by more than many steps at long prompts)
                let mut decode = f64::INFINITY;
                for _ in 0..args.repeats {
                    let (t, w0) = (Instant::now(), waited(&dec));
                    dec.generate(&prompts, &Sampling::greedy(1))?;
                    pre = fastest(pre, (t.elapsed().as_secs_f64(), waited(&dec) - w0));
                    let (t, w0) = (Instant::now(), waited(&dec));
                    dec.generate(&prompts, &Sampling::greedy(args.new_tokens))?;
                    let elapsed = t.elapsed();
                    all = fastest(all, (elapsed.as_secs_f64(), waited(&dec) - w0));
                    decode = decode.min((elapsed - dec.last_prefill_time()).as_secs_f64());
                }
                let ((prefill, prefill_wait), (total, total_wait)) = (pre, all);
                // the host waits of one decode step beyond the one for its logits
                dec.prefill(&prompts, PrefillLogits::Last)?;
                let feed: Vec<u32> = prompts.iter().map(|p| p[0]).collect();
                let waits = dec.host_waits();
                dec.decode_step(&feed)?;
                let waits_per_step = dec.host_waits() - waits - 1;
                let step = decode.max(1e-9) / (args.new_tokens - 1) as f64;
                let queued = ((total - total_wait) - (prefill - prefill_wait)).max(0.0)
                    / (args.new_tokens - 1) as f64;
                let rate = batch as f64 / step;
                let work = step_work(&config, streamed, args.kv_dtype, context, batch);
                let floor = step_floor(work, measured, fp8_products);
                println!(
                    "  batch {batch:>3}: prefill {:.2} ms, decode {:.3} ms/step ({:.2}x the \
                     floor of {:.3} ms, {}-bound: {:.3} GB read in {:.3} ms, {:.1} GFLOP in \
                     {:.3} ms; the host queues it in {:.3} ms), {rate:.0} tokens/s; host waits \
                     in a decode step beyond its logits': {waits_per_step}",
                    prefill * 1e3,
                    step * 1e3,
                    step / floor.secs(),
                    floor.secs() * 1e3,
                    floor.binding(),
                    work.bytes / GB,
                    floor.memory * 1e3,
                    work.flops / 1e9,
                    floor.compute * 1e3,
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
        let back = Some(lc.into_parts()?.1);
        if lora.is_some() {
            lora_state = back;
        } else {
            state = back;
        }
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
    // the unmerged adapters against the merged model (LoRA's goal: at most 10 % slower)
    let merged = Variant {
        lora: Some(LoraMode::Merged),
        ..bf16
    };
    if variants.contains(&merged) {
        println!("\nLoRA unmerged against merged (graphs as set), decode tokens/s:");
        for &batch in &args.batches {
            let Some(&(_, _, m, _)) = of(&merged, batch) else {
                continue;
            };
            let mut line = format!("  batch {batch:>3}: merged {m:.0} tokens/s");
            for v in variants
                .iter()
                .filter(|v| v.lora == Some(LoraMode::Unmerged) && v.graphs == merged.graphs)
            {
                if let Some(&(_, _, r, _)) = of(v, batch) {
                    line += &format!("; {} {:.3}x", v.name(), r / m.max(1e-9));
                }
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
    /// bf16 products of a few tokens on the decoder's tensor-core kernel (the default;
    /// else on cuBLAS).
    bf16_mma: bool,
    /// LoRA adapters beside the bf16 base, applied as the mode says (`--lora`).
    lora: Option<LoraMode>,
    /// Unmerged adapters' `A` products riding their base products' launch
    /// (`GpuDecoder::set_lora_riders`).
    riders: bool,
}

impl Variant {
    fn name(&self) -> String {
        match (self.dtype, self.compute, self.limits) {
            (RolloutDtype::Bf16, ..) if !self.grouped => "bf16 per expert".into(),
            (RolloutDtype::Bf16, ..) if !self.device => "bf16 routed on the host".into(),
            (RolloutDtype::Bf16, ..) if !self.bf16_mma => "bf16 cuBLAS".into(),
            (RolloutDtype::Bf16, ..) if self.lora == Some(LoraMode::Merged) => {
                "bf16 LoRA merged".into()
            }
            (RolloutDtype::Bf16, ..) if self.lora.is_some() && self.riders => {
                "bf16 LoRA riders".into()
            }
            (RolloutDtype::Bf16, ..) if self.lora.is_some() => "bf16 LoRA".into(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_per_row_counts_the_products_of_one_sequence() -> Result<(), Box<dyn Error>> {
        let dense = config(28, false)?;
        let m = &dense.model;
        let layer = (m.q_rows() + 2 * m.kv_rows()) * m.hidden
            + m.hidden * m.q_rows()
            + 3 * m.ffn * m.hidden;
        // the head, not the embedding
        let want = m.layers * layer + m.vocab * m.hidden;
        assert_eq!(weights_per_row(&dense), want as f64);
        assert!((6.9e9..7.2e9).contains(&weights_per_row(&dense)));
        // of 128 experts of 768 the top 8, and the router
        let moe = config(2, true)?;
        let m = &moe.model;
        let layer = (m.q_rows() + 2 * m.kv_rows()) * m.hidden
            + m.hidden * m.q_rows()
            + 128 * m.hidden
            + 8 * 3 * 768 * m.hidden;
        let want = m.layers * layer + m.vocab * m.hidden;
        assert_eq!(weights_per_row(&moe), want as f64);
        Ok(())
    }

    #[test]
    fn step_work_adds_each_sequences_kv_cache_and_attention() -> Result<(), Box<dyn Error>> {
        let c = config(28, false)?;
        let one = step_work(&c, 1000, KvDtype::Bf16, 64.0, 1);
        let four = step_work(&c, 1000, KvDtype::Bf16, 64.0, 4);
        // K and V of 4 kv heads of 128 bf16, 28 layers, 64 positions
        let kv = (28 * 2 * 4 * 128 * 2 * 64) as f64;
        assert_eq!((one.bytes, four.bytes), (1000.0 + kv, 1000.0 + 4.0 * kv));
        let attention = 4.0 * (28 * 28 * 128 * 64) as f64;
        assert_eq!(one.flops, 2.0 * weights_per_row(&c) + attention);
        assert_eq!(four.flops, 4.0 * one.flops);
        let f32_kv = step_work(&c, 1000, KvDtype::F32, 64.0, 1);
        assert_eq!(f32_kv.bytes, 1000.0 + 2.0 * kv);
        Ok(())
    }

    #[test]
    fn the_floor_is_the_larger_bound() {
        let rates = Rates {
            read: 3e12,
            tensor: 700e12,
        };
        let work = StepWork {
            bytes: 15e9,
            flops: 1e12,
        };
        let f = step_floor(work, rates, false);
        assert_eq!((f.memory, f.compute), (5e-3, 1e12 / 700e12));
        assert_eq!((f.secs(), f.binding()), (5e-3, "memory"));
        let heavy = StepWork {
            bytes: 1e9,
            flops: 1.4e12,
        };
        let f = step_floor(heavy, rates, false);
        assert_eq!((f.secs(), f.binding()), (2e-3, "compute"));
        // fp8 products at twice the bf16 rate
        assert_eq!(step_floor(heavy, rates, true).compute, 1e-3);
    }

    #[test]
    fn operands_are_varied_and_in_range() {
        let v = operands(4096);
        assert!(v.iter().all(|x| (-1.0..=1.0).contains(&x.to_f32())));
        let zeros = v.iter().filter(|x| x.to_f32() == 0.0).count();
        assert!(zeros < 8, "{zeros} zeros");
        let distinct: std::collections::HashSet<u16> = v.iter().map(|x| x.to_bits()).collect();
        assert!(distinct.len() > 1000);
    }
}
