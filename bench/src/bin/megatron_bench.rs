//! Benchmark of the GPU Megatron executor on a synthetic Qwen2.5-7B-shaped model (hidden 3584,
//! ffn 18944, vocab 152064, 28 layers, 28 heads in 4 query groups, head dim 128, q/k/v biases,
//! untied head), W = 2, training layouts TP2/PP1 and TP1/PP2 to rollout T ∈ {1, 2}, with the
//! hardware ceilings measured in the same process.
//!
//! ```text
//! export NCCL_NVLS_ENABLE=0
//! megatron_bench [--layers 28] [--iters 5] [--offload-iters 2] [--skip-offload] [--trace DIR]
//! ```
//!
//! With `--trace DIR`, one more enter + exit per layout and T (with offload unless
//! `--skip-offload`) is traced and written to `DIR/megatron_tp{TP}_pp{PP}_t{T}.json` (a Chrome /
//! Perfetto trace: one track per rank and stream, spans from CUDA events on the streams), and a
//! per-rank, per-stream summary is printed.
//!
//! Floor of a resident enter = the larger of (bytes a rank receives ÷ the best measured NCCL
//! receive rate) and (bytes a rank copies locally, read + written, ÷ the device-to-device copy
//! rate), maximised over ranks. Floor of an enter with offload = bytes a rank offloads ÷ the
//! pinned device→host rate; of the exit = the same bytes ÷ the host→device rate.

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaSlice;
use half::bf16;
use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy, Phase, Reshard, Span, Switching};
use lifecycle_cuda::{
    alloc_device, alloc_pinned, check_environment, peer_copy_rate, CudaError, RankExecutor,
    ThreadRankPool,
};
use lifecycle_layout::megatron::ModelSpec;
use lifecycle_layout::megatron::{MegatronLayout, RolloutLayout, RolloutVocab};
use lifecycle_megatron::{GpuConfig, MegatronGpuBackend, MegatronGpuState, PinnedPool, Transport};

const GB: f64 = 1e9;
const WORLD: usize = 2;

struct Args {
    layers: usize,
    iters: usize,
    offload_iters: usize,
    offload: bool,
    trace: Option<std::path::PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        layers: 28,
        iters: 5,
        offload_iters: 2,
        offload: true,
        trace: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .filter(|&v: &usize| v > 0)
                .ok_or_else(|| format!("{name} needs a positive integer"))
        };
        match arg.as_str() {
            "--layers" => a.layers = num("--layers")?,
            "--iters" => a.iters = num("--iters")?,
            "--offload-iters" => a.offload_iters = num("--offload-iters")?,
            "--skip-offload" => a.offload = false,
            "--trace" => {
                a.trace = Some(
                    it.next()
                        .ok_or("--trace needs a folder for the trace files")?
                        .into(),
                )
            }
            "-h" | "--help" => {
                return Err("usage: megatron_bench [--layers 28] [--iters 5] [--offload-iters 2] [--skip-offload] [--trace DIR]".into())
            }
            other => return Err(format!("unknown argument `{other}` (try --help)")),
        }
    }
    Ok(a)
}

fn qwen_7b(layers: usize) -> ModelSpec {
    ModelSpec {
        hidden: 3584,
        heads: 28,
        query_groups: 4,
        head_dim: 128,
        ffn: 18944,
        vocab: 152_064,
        layers,
        qkv_bias: true,
        tied_embeddings: false,
        make_vocab_size_divisible_by: 128,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn mib(b: u64) -> String {
    if b == u64::MAX {
        "never".into()
    } else {
        format!("{} MiB", b >> 20)
    }
}

/// Messages and bulk copies of rank 0's schedule under the lifecycle's current plan.
fn plan_messages(lc: &Lifecycle<MegatronGpuBackend>) -> Result<String, Box<dyn Error>> {
    let plan = lc.backend().plan(lc.peek_state())?;
    Ok(plan.schedule(0).map_or(String::new(), |s| {
        let (sent, got) = s.messages();
        format!(
            "rank 0: {} steps, {sent} sends, {got} receives, {} peer copies, {} tiles, {} driver copies",
            s.steps.len(),
            s.pushes.len(),
            s.tiles.len(),
            s.local_bulk.len()
        )
    }))
}

fn ms(s: f64) -> String {
    format!("{:.2} ms", s * 1e3)
}

struct Ceilings {
    link: f64,
    /// (message MiB, per-rank receive rate) of grouped send/receive.
    sendrecv: Vec<(u64, f64)>,
    d2d: f64,
    h2d: f64,
    d2h: f64,
    lines: Vec<String>,
}

/// Times `f` (which queues work and synchronises) `iters` times after 2 warm-ups; the median.
fn timed(iters: usize, mut f: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    let mut ts = Vec::new();
    for k in 0..iters + 2 {
        let t = Instant::now();
        f()?;
        if k >= 2 {
            ts.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(ts))
}

fn ceilings(pool: &ThreadRankPool, iters: usize) -> Result<Ceilings, Box<dyn Error>> {
    let mut lines = Vec::new();
    let mut link: f64 = 0.0;
    let mut sendrecv = Vec::new();
    // Grouped send + receive between the two ranks, both directions at once.
    for mib in [128usize, 256, 1024, 2048, 4096] {
        let n = (mib << 20) / 2;
        let t = pool.run(&|ctx| {
            // SAFETY: contents irrelevant to the timing; never read on the host.
            let a: CudaSlice<bf16> = unsafe { alloc_device(&ctx.compute, n, ctx.rank, "send")? };
            // SAFETY: as above.
            let mut b: CudaSlice<bf16> =
                unsafe { alloc_device(&ctx.compute, n, ctx.rank, "recv")? };
            let nccl = ctx.nccl_stream();
            ctx.order(&ctx.compute, &nccl)?;
            let peer = (1 - ctx.rank) as i32;
            let t = timed(iters, || {
                ctx.group_start()?;
                let s = ctx.comm.send(&a, peer);
                let r = ctx.comm.recv(&mut b, peer);
                ctx.group_end()?;
                s.map_err(|e| CudaError::nccl(ctx.rank, "ncclSend", e))?;
                r.map_err(|e| CudaError::nccl(ctx.rank, "ncclRecv", e))?;
                ctx.wait(&[&nccl], "send/recv ceiling")
            })?;
            ctx.order(&nccl, &ctx.compute)?;
            drop((a, b));
            ctx.compute.synchronize().map_err(ctx.drv("sync", 0))?;
            Ok(t)
        })?;
        let t = t.iter().cloned().fold(0.0, f64::max);
        let rate = (n * 2) as f64 / t;
        link = link.max(rate);
        sendrecv.push((mib as u64, rate));
        lines.push(format!(
            "NCCL send/recv {mib} MiB each way: {} -> receive {:.1} GB/s per rank",
            ms(t),
            rate / GB
        ));
    }
    for mib in [2048usize, 4096] {
        let n = (mib << 20) / 2 / WORLD * WORLD;
        let t = pool.run(&|ctx| {
            // SAFETY: contents irrelevant to the timing.
            let a: CudaSlice<bf16> =
                unsafe { alloc_device(&ctx.compute, n / WORLD, ctx.rank, "gather in")? };
            // SAFETY: as above.
            let mut b: CudaSlice<bf16> =
                unsafe { alloc_device(&ctx.compute, n, ctx.rank, "gather out")? };
            let nccl = ctx.nccl_stream();
            ctx.order(&ctx.compute, &nccl)?;
            let t = timed(iters, || {
                ctx.comm
                    .all_gather(&a, &mut b)
                    .map_err(|e| CudaError::nccl(ctx.rank, "all_gather", e))?;
                nccl.synchronize().map_err(ctx.drv("sync", 0))
            })?;
            ctx.order(&nccl, &ctx.compute)?;
            drop((a, b));
            ctx.compute.synchronize().map_err(ctx.drv("sync", 0))?;
            Ok(t)
        })?;
        let t = t.iter().cloned().fold(0.0, f64::max);
        let rate = (n * 2) as f64 * (WORLD - 1) as f64 / WORLD as f64 / t;
        link = link.max(rate);
        lines.push(format!(
            "NCCL all-gather {mib} MiB out per rank: {} -> receive {:.1} GB/s per rank",
            ms(t),
            rate / GB
        ));
    }
    // Copy-engine writes into the peer's memory (the peer-copy transport), both ranks at once.
    for mib in [1024usize, 4096] {
        match peer_copy_rate(pool, mib << 20, iters)? {
            Some(rate) => {
                link = link.max(rate);
                lines.push(format!(
                    "peer copy (copy engines) {mib} MiB each way: {} -> receive {:.1} GB/s per rank",
                    ms((mib << 20) as f64 / rate),
                    rate / GB
                ));
            }
            None => lines.push("peer copy: no peer access between the GPUs (not measured)".into()),
        }
    }
    let nb = 4usize << 30;
    let d2d = pool.run(&|ctx| {
        // SAFETY: contents irrelevant to the timing.
        let a: CudaSlice<u8> = unsafe { alloc_device(&ctx.compute, nb, ctx.rank, "d2d src")? };
        // SAFETY: as above.
        let mut b: CudaSlice<u8> = unsafe { alloc_device(&ctx.compute, nb, ctx.rank, "d2d dst")? };
        let t = timed(iters, || {
            ctx.compute
                .memcpy_dtod(&a, &mut b)
                .map_err(ctx.drv("dtod", 0))?;
            ctx.compute.synchronize().map_err(ctx.drv("sync", 0))
        })?;
        Ok(2.0 * nb as f64 / t)
    })?;
    let d2d = d2d.iter().cloned().fold(f64::INFINITY, f64::min);
    lines.push(format!(
        "device-to-device copy 4 GiB: {:.0} GB/s (read + written)",
        d2d / GB
    ));
    let hb = 1usize << 30;
    let pinned = pool.run(&|ctx| {
        // SAFETY: contents irrelevant to the timing.
        let mut h = unsafe { alloc_pinned::<u8>(&ctx.copy, hb, ctx.rank, "pinned bench")? };
        // SAFETY: as above.
        let mut d: CudaSlice<u8> = unsafe { alloc_device(&ctx.copy, hb, ctx.rank, "pinned dev")? };
        let up = timed(iters, || {
            ctx.copy
                .memcpy_htod(&h, &mut d)
                .map_err(ctx.drv("h2d", 0))?;
            ctx.copy.synchronize().map_err(ctx.drv("sync", 0))
        })?;
        let down = timed(iters, || {
            ctx.copy
                .memcpy_dtoh(&d, &mut h)
                .map_err(ctx.drv("d2h", 0))?;
            ctx.copy.synchronize().map_err(ctx.drv("sync", 0))
        })?;
        Ok((hb as f64 / up, hb as f64 / down))
    })?;
    let h2d = pinned.iter().map(|x| x.0).fold(f64::INFINITY, f64::min);
    let d2h = pinned.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
    lines.push(format!(
        "pinned 1 GiB, both GPUs at once (slowest rank): H2D {:.1} GB/s, D2H {:.1} GB/s",
        h2d / GB,
        d2h / GB
    ));
    for l in &lines {
        println!("ceiling  {l}");
    }
    Ok(Ceilings {
        link,
        sendrecv,
        d2d,
        h2d,
        d2h,
        lines,
    })
}

struct Row {
    what: String,
    ours: f64,
    floor: f64,
    /// The floor with the send/receive rate at the message size used (None: nothing received).
    floor_sr: Option<f64>,
}

fn time_cycles(
    lc: &mut Lifecycle<MegatronGpuBackend>,
    iters: usize,
    warm_up: bool,
) -> Result<(f64, f64), Box<dyn Error>> {
    if warm_up {
        lc.enter()?;
        lc.exit()?;
    }
    lc.reset_metrics();
    let (mut en, mut ex) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        let t = Instant::now();
        lc.enter()?;
        en.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        lc.exit()?;
        ex.push(t.elapsed().as_secs_f64());
    }
    Ok((median(en), median(ex)))
}

fn lifecycle(
    backend: MegatronGpuBackend,
    state: MegatronGpuState,
    memory: MemoryPolicy,
) -> Result<Lifecycle<MegatronGpuBackend>, Box<dyn Error>> {
    Ok(Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: Switching::Lazy,
            memory,
        },
    )?)
}

/// The work of one track (a rank's stream, or the host's row) of a trace.
#[derive(Debug, Clone, PartialEq)]
struct TrackSummary {
    /// The rank (`None`: the lifecycle's host row).
    rank: Option<usize>,
    /// The stream (`compute`, `aux`, `nccl`, `copy`) or `switch` for the host row.
    track: String,
    /// Start of the first span, in microseconds of the trace.
    first_us: f64,
    /// End of the last span.
    last_us: f64,
    /// Sum of the span durations.
    busy_us: f64,
    /// Spans.
    spans: usize,
    /// Bytes the spans moved.
    bytes: u64,
}

/// One [`TrackSummary`] per (rank, track) of `spans`, the host row first, then by rank and
/// track name.
fn summarise(spans: &[Span]) -> Vec<TrackSummary> {
    let mut keys: Vec<(Option<usize>, &str)> =
        spans.iter().map(|s| (s.rank, s.track.as_str())).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .map(|(rank, track)| {
            let mine = spans.iter().filter(|s| s.rank == rank && s.track == track);
            let mut t = TrackSummary {
                rank,
                track: track.to_string(),
                first_us: f64::INFINITY,
                last_us: f64::NEG_INFINITY,
                busy_us: 0.0,
                spans: 0,
                bytes: 0,
            };
            for s in mine {
                t.first_us = t.first_us.min(s.start_us);
                t.last_us = t.last_us.max(s.start_us + s.duration_us);
                t.busy_us += s.duration_us;
                t.spans += 1;
                t.bytes += s.bytes;
            }
            t
        })
        .collect()
}

/// One traced enter + exit of `lc`: writes the Chrome trace to `dir/name.json` and prints, per
/// rank and stream, when the device work started and ended, how long it was busy, the bytes it
/// moved and its first spans.
fn traced_cycle(
    lc: &mut Lifecycle<MegatronGpuBackend>,
    dir: &std::path::Path,
    name: &str,
) -> Result<(), Box<dyn Error>> {
    lc.enable_trace();
    lc.enter()?;
    lc.exit()?;
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{name}.json"));
    lc.trace().write_chrome(&path)?;
    let spans = lc.trace().spans();
    let t0 = spans
        .iter()
        .map(|s| s.start_us)
        .fold(f64::INFINITY, f64::min);
    println!(
        "  trace of one enter + exit ({} spans) written to {}; work per rank and stream (ms after the first span):",
        spans.len(),
        path.display()
    );
    for t in summarise(spans) {
        let detail: Vec<String> = spans
            .iter()
            .filter(|s| s.rank == t.rank && s.track == t.track)
            .take(8)
            .map(|s| {
                format!(
                    "{} {:.3}+{:.3}",
                    s.name,
                    (s.start_us - t0) / 1e3,
                    s.duration_us / 1e3
                )
            })
            .collect();
        let who = t.rank.map_or("host  ".to_string(), |r| format!("rank {r}"));
        let rate = if t.busy_us > 0.0 {
            format!(
                " ({:.1} GB/s busy)",
                t.bytes as f64 / (t.busy_us * 1e-6) / GB
            )
        } else {
            String::new()
        };
        println!(
            "    {who} {:>8}: {:.3} .. {:.3} ms, busy {:.3} ms, {} spans, {:.3} GB{rate}: {}",
            t.track,
            (t.first_us - t0) / 1e3,
            (t.last_us - t0) / 1e3,
            t.busy_us / 1e3,
            t.spans,
            t.bytes as f64 / GB,
            detail.join(", ")
        );
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("megatron_bench: error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    let wall = Instant::now();
    check_environment(WORLD)?;
    let pool = Arc::new(ThreadRankPool::new(WORLD)?);
    println!(
        "megatron_bench: W = {WORLD}, {} layers, median of {} resident / {} offload cycles",
        args.layers, args.iters, args.offload_iters
    );
    let c = ceilings(&pool, args.iters)?;
    let model = qwen_7b(args.layers);
    let params: usize = model
        .hf_tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    println!(
        "model: Qwen2.5-7B shapes, {:.3} B parameters",
        params as f64 / 1e9
    );
    let pinned = Arc::new(PinnedPool::default());
    let mut rows: Vec<Row> = Vec::new();
    let mut offload_rows: Vec<Row> = Vec::new();
    for (tp, pp) in [(2usize, 1usize), (1, 2)] {
        let layout = MegatronLayout::new(model, tp, pp, 1)?;
        let t0 = Instant::now();
        let mut state =
            MegatronGpuBackend::new(pool.clone(), RolloutLayout::new(1, RolloutVocab::Unpadded))?
                .synthetic_state(layout, 1234, 0.02)?;
        println!(
            "\nTP{tp}/PP{pp}: synthetic state made on the GPUs in {:.2} s; per rank {:.2} GB of training state",
            t0.elapsed().as_secs_f64(),
            state.rank_bytes(0).unwrap_or(0) as f64 / GB
        );
        for t in [1usize, 2] {
            let rollout = RolloutLayout::new(t, RolloutVocab::Unpadded);
            let mut backend =
                MegatronGpuBackend::new(pool.clone(), rollout)?.with_pinned_pool(pinned.clone());
            let plan = backend.plan(&state)?;
            let mut floor: f64 = 0.0;
            let (mut max_recv, mut local_floor) = (0usize, 0.0f64);
            for r in 0..WORLD {
                let Some(s) = plan.schedule(r) else { continue };
                let (recv, sent, local) = (s.recv_elems * 2, s.send_elems * 2, s.local_elems * 2);
                let f_net = recv as f64 / c.link;
                let f_local = 2.0 * local as f64 / c.d2d;
                floor = floor.max(f_net).max(f_local);
                max_recv = max_recv.max(recv);
                local_floor = local_floor.max(f_local);
                println!(
                    "  T={t} rank {r}: rollout {:.3} GB = receives {:.3} GB + copies locally {:.3} GB; sends {:.3} GB; {} steps, staging {:.0} MB at 2 in flight; floor max({} net, {} local)",
                    (plan.rollout_len() * 2) as f64 / GB,
                    recv as f64 / GB,
                    local as f64 / GB,
                    sent as f64 / GB,
                    s.steps.len(),
                    (s.slot_bytes() * 2) as f64 / 1e6,
                    ms(f_net),
                    ms(f_local)
                );
            }
            let remote = plan.plan().remote_bytes() > 0;
            let d = GpuConfig::default();
            let nccl = GpuConfig {
                transport: Transport::Nccl,
                ..d
            };
            let gib = 1u64 << 30;
            // Large runs as their own messages, large local runs by the driver's copy.
            let direct = GpuConfig {
                direct_min_bytes: 4 << 20,
                memcpy_min_bytes: 16 << 20,
                overlap_blocks_per_sm: 2,
                ..nccl
            };
            let configs: Vec<GpuConfig> = if remote {
                vec![
                    d,
                    GpuConfig {
                        memcpy_min_bytes: u64::MAX,
                        ..d
                    },
                    GpuConfig {
                        peer_tile_max_bytes: 0,
                        ..d
                    },
                    GpuConfig {
                        peer_tile_max_bytes: 4 << 20,
                        ..d
                    },
                    GpuConfig {
                        split_local_bulk: true,
                        ..d
                    },
                    nccl,
                    GpuConfig {
                        bucket_bytes: gib,
                        ..nccl
                    },
                    GpuConfig {
                        bucket_bytes: 2 * gib,
                        ..nccl
                    },
                    GpuConfig {
                        bucket_bytes: gib,
                        ..direct
                    },
                ]
            } else {
                vec![
                    d,
                    GpuConfig {
                        memcpy_min_bytes: u64::MAX,
                        ..d
                    },
                    GpuConfig {
                        memcpy_min_bytes: 1 << 20,
                        ..d
                    },
                    GpuConfig {
                        split_local_bulk: true,
                        ..d
                    },
                    GpuConfig {
                        memcpy_min_bytes: 1 << 20,
                        split_local_bulk: true,
                        ..d
                    },
                ]
            };
            let mut best = (f64::INFINITY, GpuConfig::default(), false);
            for cfg in configs {
                backend = backend.with_config(cfg)?;
                let mut lc = lifecycle(backend, state, MemoryPolicy::resident())?;
                let (en, ex) = time_cycles(&mut lc, args.iters, true)?;
                let m = lc.metrics().clone();
                let tr = m.phase(Phase::Transfer);
                let msgs = plan_messages(&lc)?;
                let peer = lc.backend().plan(lc.peek_state())?.peer_copy();
                println!(
                    "  T={t} resident, {}, bucket {:>4} MiB x {}, direct >= {}, memcpy >= {}, peer tiles < {}, split bulk {}, {} blocks/SM: enter {} (transfer phase {} avg), exit {}; {msgs}; received {:.3} GB per switch (all ranks), peak staging {:.0} MB",
                    if peer { "peer copies" } else { "NCCL steps " },
                    cfg.bucket_bytes >> 20,
                    cfg.in_flight,
                    mib(cfg.direct_min_bytes),
                    mib(cfg.memcpy_min_bytes),
                    mib(cfg.peer_tile_max_bytes),
                    cfg.split_local_bulk,
                    cfg.overlap_blocks_per_sm,
                    ms(en),
                    ms(tr.wall.as_secs_f64() / tr.count.max(1) as f64),
                    ms(ex),
                    tr.bytes.device_to_device as f64 / tr.count.max(1) as f64 / GB,
                    tr.peak_extra_bytes as f64 / 1e6
                );
                if en < best.0 {
                    best = (en, cfg, peer);
                }
                let (b, s) = lc.into_parts()?;
                backend = b;
                state = s;
            }
            let trace_name = format!("megatron_tp{tp}_pp{pp}_t{t}");
            if let (Some(dir), false) = (&args.trace, args.offload) {
                backend = backend.with_config(best.1)?;
                let mut lc = lifecycle(backend, state, MemoryPolicy::resident())?;
                traced_cycle(&mut lc, dir, &trace_name)?;
                let (b, s) = lc.into_parts()?;
                backend = b;
                state = s;
            }
            let sr_rate = c
                .sendrecv
                .iter()
                .find(|(mib, _)| *mib == best.1.bucket_bytes >> 20)
                .map(|x| x.1);
            let sr_rate = sr_rate.filter(|_| !best.2);
            rows.push(Row {
                what: if best.2 {
                    format!("TP{tp}/PP{pp} -> T={t} enter (peer copies)")
                } else {
                    format!(
                        "TP{tp}/PP{pp} -> T={t} enter ({} MiB x {}, direct {})",
                        best.1.bucket_bytes >> 20,
                        best.1.in_flight,
                        mib(best.1.direct_min_bytes)
                    )
                },
                ours: best.0,
                floor,
                floor_sr: sr_rate
                    .filter(|_| max_recv > 0)
                    .map(|r| (max_recv as f64 / r).max(local_floor)),
            });
            if args.offload {
                backend = backend.with_config(best.1)?;
                let t1 = Instant::now();
                let cached = backend.reserve_pinned(&state, MemoryPolicy::default())?;
                println!(
                    "  pinned host memory for the offload: {:.1} GB cached for both ranks ({:.1} s to reserve)",
                    cached as f64 / GB,
                    t1.elapsed().as_secs_f64()
                );
                let bytes = (0..WORLD)
                    .filter_map(|r| state.offload_bytes(r))
                    .map(|(p, o)| (p + o) as f64)
                    .fold(0.0, f64::max);
                let mut lc = lifecycle(backend, state, MemoryPolicy::default())?;
                let (en, ex) = time_cycles(&mut lc, args.offload_iters, false)?;
                let m = lc.metrics().clone();
                let per = |p: Phase| m.phase(p).wall.as_secs_f64() / m.phase(p).count.max(1) as f64;
                println!(
                    "  T={t} offload params + main + Adam ({:.1} GB/rank): enter {} (transfer {}, offload wait {}), exit {} (release {}, reload {})",
                    bytes / GB,
                    ms(en),
                    ms(per(Phase::Transfer)),
                    ms(per(Phase::Offload)),
                    ms(ex),
                    ms(per(Phase::Release)),
                    ms(per(Phase::Reload))
                );
                offload_rows.push(Row {
                    what: format!("TP{tp}/PP{pp} -> T={t} enter with offload"),
                    ours: en,
                    floor: bytes / c.d2h,
                    floor_sr: None,
                });
                offload_rows.push(Row {
                    what: format!("TP{tp}/PP{pp} -> T={t} exit with reload"),
                    ours: ex,
                    floor: bytes / c.h2d,
                    floor_sr: None,
                });
                if let Some(dir) = &args.trace {
                    traced_cycle(&mut lc, dir, &trace_name)?;
                }
                let (b, s) = lc.into_parts()?;
                drop(b);
                state = s;
            }
        }
        drop(state);
    }
    println!("\nSUMMARY (W = {WORLD}, ceilings measured above in this process)");
    for l in &c.lines {
        println!("  {l}");
    }
    println!(
        "  link rate used for floors: {:.1} GB/s (best of the NCCL figures); d2d {:.0} GB/s",
        c.link / GB,
        c.d2d / GB
    );
    println!(
        "  {:<46} {:>10} {:>10} {:>8} {:>5}   (floor at the send/recv rate of the bucket size)",
        "figure", "ours", "floor", "ratio", "<=1.1"
    );
    for r in rows.iter().chain(&offload_rows) {
        let sr = r.floor_sr.map_or(String::new(), |f| {
            format!("   ({}, {:.2}x)", ms(f), r.ours / f)
        });
        println!(
            "  {:<46} {:>10} {:>10} {:>7.2}x {:>5}{sr}",
            r.what,
            ms(r.ours),
            ms(r.floor),
            r.ours / r.floor,
            if r.ours <= 1.1 * r.floor { "yes" } else { "NO" }
        );
    }
    println!("total wall {:.1} s", wall.elapsed().as_secs_f64());
    // Unpinning ~100 GB chunk by chunk takes tens of seconds; the process exit releases it.
    std::mem::forget(pinned);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(rank: Option<usize>, track: &str, start_us: f64, duration_us: f64, bytes: u64) -> Span {
        Span {
            name: "x".into(),
            phase: Phase::Transfer,
            rank,
            track: track.into(),
            start_us,
            duration_us,
            bytes,
            link: None,
        }
    }

    #[test]
    fn summaries_per_rank_and_stream() {
        let spans = vec![
            span(Some(1), "nccl", 10.0, 5.0, 100),
            span(None, "switch", 0.0, 50.0, 0),
            span(Some(0), "nccl", 12.0, 4.0, 40),
            span(Some(1), "nccl", 20.0, 10.0, 300),
            span(Some(1), "aux", 2.0, 1.0, 8),
        ];
        let got = summarise(&spans);
        let keys: Vec<(Option<usize>, &str)> =
            got.iter().map(|t| (t.rank, t.track.as_str())).collect();
        assert_eq!(
            keys,
            [
                (None, "switch"),
                (Some(0), "nccl"),
                (Some(1), "aux"),
                (Some(1), "nccl")
            ]
        );
        let n1 = &got[3];
        assert_eq!((n1.first_us, n1.last_us, n1.busy_us), (10.0, 30.0, 15.0));
        assert_eq!((n1.spans, n1.bytes), (2, 400));
        assert!(summarise(&[]).is_empty());
    }
}
