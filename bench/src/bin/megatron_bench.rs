//! Benchmark of the GPU Megatron executor on a synthetic Qwen2.5-7B-shaped model (hidden 3584,
//! ffn 18944, vocab 152064, 28 layers, 28 heads in 4 query groups, head dim 128, q/k/v biases,
//! untied head), or with `--model qwen3-30b-a3b` the Qwen3-30B-A3B shapes (128 experts of 768
//! per layer in Megatron-Core's grouped-GEMM expert layout, expert TP = TP; with `--ep N > 1`
//! the one layout is TP1/PP1/DP W with EP N; the rollout places the experts by
//! `--experts tp|ep`), W = 2 by default: training layouts TP2/PP1 and TP1/PP2 to rollout
//! T ∈ {1, 2}, with the hardware ceilings measured in the same process. At `--world 1` (one GPU) the only
//! layout is TP1/PP1 → T = 1; the layouts whose TP × PP is not W, and the T that do not divide
//! W, are skipped (the run says which), and the link ceilings read `n/a (W = 1)`.
//!
//! ```text
//! export NCCL_NVLS_ENABLE=0
//! cargo run --release -p lifecycle-bench --bin megatron_bench -- [--layers 28] [--iters 5]
//!     [--offload-iters 2] [--world 2] [--skip-offload] [--trace DIR]
//!     [--model qwen2.5-7b|qwen3-30b-a3b | --config config.json] [--ep 1] [--experts tp|ep]
//! ```
//!
//! With `--trace DIR`, one more enter + exit per layout and T (with offload unless
//! `--skip-offload`; and of the fp8 enter with `--fp8`, `DIR/megatron_fp8_t{T}.json`) is traced
//! and written to `DIR/megatron_tp{TP}_pp{PP}_t{T}.json` (a Chrome /
//! Perfetto trace: one track per rank and stream, spans from CUDA events on the streams), and a
//! per-rank, per-stream summary is printed.
//!
//! Floor of a resident enter = the larger of (bytes a rank receives ÷ the best measured NCCL
//! receive rate) and (bytes a rank copies locally, read + written, ÷ the device-to-device copy
//! rate), maximised over ranks. Floor of an enter with offload = bytes a rank offloads ÷ the
//! pinned device→host rate; of the exit = the same bytes ÷ the host→device rate.

use lifecycle_layout::settings::Configure;
use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use lifecycle_bench::ceilings::{self, PinnedOrder, Timing, NO_LINK};
use lifecycle_bench::cli::positive;
use lifecycle_bench::cycles::{
    lazy_lifecycle, offload_times, phase_d2d_bytes, resident_times, time_cycles,
};
use lifecycle_bench::timing::{gbps, ms, ratio, GB};
use lifecycle_bench::trace::trace_cycle;
use lifecycle_core::{Lifecycle, MemoryPolicy, Phase, Reshard};
use lifecycle_cuda::{check_environment, peer_copy_rate, RankExecutor, ThreadRankPool};
use lifecycle_layout::megatron::MegatronLayout;
use lifecycle_layout::{ExpertPlacement, ModelSpec};
use lifecycle_layout::{RolloutLayout, RolloutVocab};
use lifecycle_megatron::{GpuConfig, MegatronGpuBackend, PinnedPool, Transport};

/// Training layouts (TP, PP) tried, in this order; those whose TP × PP is not W are skipped.
const LAYOUTS: [(usize, usize); 3] = [(2, 1), (1, 2), (1, 1)];
/// Rollout tensor-parallel degrees tried; those that do not divide W are skipped.
const ROLLOUT_TP: [usize; 2] = [1, 2];

/// Benchmark of the GPU Megatron executor on a synthetic Qwen2.5-7B-shaped model: resident and
/// offloaded switches from each training layout with TP × PP = W to each rollout T dividing W,
/// next to the hardware ceilings measured in the same process.
#[derive(Debug, Parser)]
#[command(name = "megatron_bench")]
struct Cli {
    /// Decoder layers of the model.
    #[arg(long, default_value_t = 28, value_parser = positive::<usize>)]
    layers: usize,
    /// Timed resident cycles (and runs of each ceiling); the median is reported.
    #[arg(long, default_value_t = 5, value_parser = positive::<usize>)]
    iters: usize,
    /// Timed cycles with the training state offloaded; the median is reported.
    #[arg(long, default_value_t = 2, value_parser = positive::<usize>)]
    offload_iters: usize,
    /// Ranks, one GPU each (1: TP1/PP1 → T = 1 only).
    #[arg(long, default_value_t = 2, value_parser = positive::<usize>)]
    world: usize,
    /// Skip the switches with the parameters, main weights and Adam state offloaded.
    #[arg(long)]
    skip_offload: bool,
    /// Trace one more enter + exit per layout and T into DIR/megatron_tp{TP}_pp{PP}_t{T}.json.
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// The model's shapes: qwen2.5-7b (dense) or qwen3-30b-a3b (128 experts per layer; 8
    /// layers of it hold 5.6 B parameters).
    #[arg(long, default_value = "qwen2.5-7b", value_parser = ["qwen2.5-7b", "qwen3-30b-a3b"])]
    model: String,
    /// The model's shapes from a Hugging Face `config.json` instead of `--model` (its own
    /// layer count; `--layers` is ignored), e.g. to time the same shapes as a PyTorch job.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Expert-parallel degree of the training layout (mixture-of-experts models).
    #[arg(long, default_value_t = 1, value_parser = positive::<usize>)]
    ep: usize,
    /// Experts in the rollout: tp (split by TP inside every expert) or ep (partitioned).
    #[arg(long, default_value = "tp")]
    experts: ExpertPlacement,
    /// Also time the resident switch with fp8 rollout weights (the bf16 transfer into a
    /// staging buffer, then the quantising pass) at the best bf16 settings, against the floor
    /// of one read of the parameters and one write of the fp8 rollout, and against the floor of
    /// the staged design.
    #[arg(long)]
    fp8: bool,
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

struct Ceilings {
    /// The best per-rank receive rate of the link figures (`None` at W = 1: no link).
    link: Option<f64>,
    /// (message MiB, per-rank receive rate) of grouped send/receive.
    sendrecv: Vec<(u64, f64)>,
    d2d: f64,
    h2d: f64,
    d2h: f64,
    lines: Vec<String>,
}

/// The GPUs of a W-rank run, for the report: `both GPUs at once` at W = 2.
fn all_gpus(world: usize) -> String {
    match world {
        1 => "one GPU".into(),
        2 => "both GPUs at once".into(),
        w => format!("all {w} GPUs at once"),
    }
}

/// The ranks of a W-rank run, for the report: `both ranks` at W = 2.
fn all_ranks(world: usize) -> String {
    match world {
        1 => "the one rank".into(),
        2 => "both ranks".into(),
        w => format!("all {w} ranks"),
    }
}

fn ceilings(pool: &ThreadRankPool, iters: usize) -> Result<Ceilings, Box<dyn Error>> {
    let world = pool.world();
    // Two warm-up runs, then `iters` timed ones, back to back.
    let timing = Timing::back_to_back(2, iters);
    let mut lines = Vec::new();
    let mut link: Option<f64> = None;
    let mut best_link = |rate: f64| link = Some(link.map_or(rate, |l| l.max(rate)));
    let mut sendrecv = Vec::new();
    // Grouped send + receive with the next and the previous rank (at W = 2 both ways between
    // the two ranks), all at once.
    for mib in [128usize, 256, 1024, 2048, 4096] {
        let Some(sr) = ceilings::send_recv(pool, mib << 20, timing)? else {
            lines.push(format!("NCCL send/recv: {NO_LINK}"));
            break;
        };
        best_link(sr.recv_rate);
        sendrecv.push((mib as u64, sr.recv_rate));
        lines.push(format!(
            "NCCL send/recv {mib} MiB each way: {} -> receive {:.1} GB/s per rank",
            ms(sr.secs),
            sr.recv_rate / GB
        ));
    }
    for mib in [2048usize, 4096] {
        let a = ceilings::all_gather(pool, mib << 20, timing)?;
        if let Some(rate) = a.recv_rate {
            best_link(rate);
        }
        lines.push(format!(
            "NCCL all-gather {mib} MiB out per rank: {} -> receive {} per rank",
            ms(a.secs),
            gbps(a.recv_rate, 1, NO_LINK)
        ));
    }
    // Copy-engine writes into the peer's memory (the peer-copy transport), all ranks at once.
    for mib in [1024usize, 4096] {
        match peer_copy_rate(pool, mib << 20, iters)? {
            Some(rate) => {
                best_link(rate);
                lines.push(format!(
                    "peer copy (copy engines) {mib} MiB each way: {} -> receive {:.1} GB/s per rank",
                    ms((mib << 20) as f64 / rate),
                    rate / GB
                ));
            }
            None if world == 1 => lines.push(format!("peer copy: {NO_LINK}")),
            None => lines.push("peer copy: no peer access between the GPUs (not measured)".into()),
        }
    }
    let d2d = ceilings::device_copy(pool, 4 << 30, timing)?;
    lines.push(format!(
        "device-to-device copy 4 GiB: {:.0} GB/s (read + written)",
        d2d / GB
    ));
    let pinned = ceilings::slowest_pinned(&ceilings::pinned(
        pool,
        1 << 30,
        timing,
        PinnedOrder::Separate,
        None,
    )?);
    lines.push(format!(
        "pinned 1 GiB, {} (slowest rank): H2D {:.1} GB/s, D2H {:.1} GB/s",
        all_gpus(world),
        pinned.h2d / GB,
        pinned.d2h / GB
    ));
    for l in &lines {
        println!("ceiling  {l}");
    }
    Ok(Ceilings {
        link,
        sendrecv,
        d2d,
        h2d: pinned.h2d,
        d2h: pinned.d2h,
        lines,
    })
}

/// Time to receive `bytes` at `link` bytes per second: 0 when nothing is received, infinite
/// when bytes must cross a link that has no figure.
fn net_floor(bytes: usize, link: Option<f64>) -> f64 {
    match (bytes, link) {
        (0, _) => 0.0,
        (b, Some(l)) => b as f64 / l,
        (_, None) => f64::INFINITY,
    }
}

struct Row {
    what: String,
    ours: f64,
    floor: f64,
    /// The floor with the send/receive rate at the message size used (None: nothing received).
    floor_sr: Option<f64>,
}

/// The resident fp8 enter of `backend` (set to `cfg`) over `state`: its median of `iters`
/// against two floors at the ceilings `c`, both maximised over the ranks with the network's
/// share (the bf16 bytes a rank receives): one read of the bf16 parameters and one write of the
/// fp8 rollout (what a one-pass switch would move), and the staged design's (the bf16 transfer,
/// then the pass reading the staging buffer and writing the rollout). Hands the backend (bf16
/// again) and the state back with the report's row.
fn fp8_enter(
    backend: MegatronGpuBackend,
    state: lifecycle_megatron::MegatronGpuState,
    cfg: GpuConfig,
    (c, world): (&Ceilings, usize),
    iters: usize,
    (lname, t): (&str, usize),
    trace: Option<&std::path::Path>,
) -> Result<
    (
        MegatronGpuBackend,
        lifecycle_megatron::MegatronGpuState,
        Row,
    ),
    Box<dyn Error>,
> {
    use lifecycle_layout::fp8::RolloutDtype;
    let backend = backend
        .with_config(cfg)?
        .with_rollout_dtype(RolloutDtype::Fp8);
    let plan = backend.plan(&state)?;
    let f = plan.fp8().ok_or("an fp8 backend made a bf16 plan")?;
    // per element of the rollout: quantised ones read 2 bytes and write `bytes`, bf16 ones 2 + 2
    let (mut quantised, mut kept) = (0u64, 0u64);
    for e in &f.entries {
        if e.is_fp8() {
            quantised += e.numel() as u64;
        } else {
            kept += e.numel() as u64;
        }
    }
    let (elems, written) = ((quantised + kept) as f64, f.bytes() as f64);
    let (mut one_read, mut staged) = (0.0f64, 0.0f64);
    for r in 0..world {
        if plan.schedule(r).is_none() {
            continue;
        }
        // the planner's bytes (a one-read schedule copies only the bf16 tensors)
        let rp = &plan.plan().ranks[r];
        let net = net_floor(rp.remote_bytes() as usize, c.link);
        let local = rp.local_bytes() as f64 / 2.0;
        // one read: each local bf16 element read once, its share of the rollout written once
        let share = local / elems.max(1.0);
        one_read = one_read.max(net.max((2.0 * local + share * written) / c.d2d));
        // staged: the bf16 transfer (local bytes read and written), then the pass reading the
        // staging buffer and writing the rollout
        let pass = (2.0 * elems + written) / c.d2d;
        staged = staged.max(net.max(4.0 * local / c.d2d) + pass);
    }
    let mut lc = lazy_lifecycle(backend, state, MemoryPolicy::resident())?;
    let (en, ex) = time_cycles(&mut lc, iters, true)?;
    let m = lc.metrics().clone();
    let design = if plan.fp8_one_read() {
        "written in one read of the parameters, no staging".to_string()
    } else {
        format!(
            "staged: {:.3} GB of bf16 staging during the switch",
            (2 * f.staging_len) as f64 / GB
        )
    };
    println!(
        "  T={t} fp8 resident: {}; rollout {:.3} GB ({:.2}x the bf16 bytes), {design}; floors: \
         one read {} ({}), staged design {} ({})",
        resident_times(en, ex, &m),
        (2 * f.len) as f64 / GB,
        f.len as f64 / f.staging_len.max(1) as f64,
        ms(one_read),
        ratio(en, one_read).map_or("n/a".into(), |x| format!("{x:.2}x")),
        ms(staged),
        ratio(en, staged).map_or("n/a".into(), |x| format!("{x:.2}x")),
    );
    let how = if plan.fp8_one_read() {
        "one read"
    } else {
        "staged"
    };
    if let Some(dir) = trace {
        traced_cycle(&mut lc, dir, &format!("megatron_fp8_t{t}"))?;
    }
    let (b, s) = lc.into_parts()?;
    let row = Row {
        what: format!("{lname} -> T={t} fp8 enter ({how}; floor: one read)"),
        ours: en,
        floor: one_read,
        floor_sr: None,
    };
    Ok((b.with_rollout_dtype(RolloutDtype::Bf16), s, row))
}

/// One traced enter + exit of `lc`: writes the Chrome trace to `dir/name.json` and prints, per
/// rank and stream, when the device work started and ended, how long it was busy, the bytes it
/// moved and its first spans.
fn traced_cycle(
    lc: &mut Lifecycle<MegatronGpuBackend>,
    dir: &std::path::Path,
    name: &str,
) -> Result<(), Box<dyn Error>> {
    let traced = trace_cycle(lc, dir, name, 8)?;
    println!(
        "  trace of one enter + exit {}; work per rank and stream (ms after the first span):",
        traced.written()
    );
    for r in &traced.tracks {
        let t = &r.summary;
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
            "    {who} {:>8}: {}, {:.3} GB{rate}: {}",
            t.track,
            r.times,
            t.bytes as f64 / GB,
            r.first
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

/// The benchmark. Long by design: it is the report's script, one measurement after another in
/// the order the report prints them (each block sets up, times and prints one figure against
/// its floor), so the code reads in the order of its output.
fn run() -> Result<(), Box<dyn Error>> {
    let args = Cli::parse();
    let world = args.world;
    let wall = Instant::now();
    check_environment(world)?;
    let pool = Arc::new(ThreadRankPool::new(world)?);
    println!(
        "megatron_bench: W = {world}, {} layers, median of {} resident / {} offload cycles",
        args.layers, args.iters, args.offload_iters
    );
    let c = ceilings(&pool, args.iters)?;
    let (model, moe, shapes) = match &args.config {
        Some(path) => {
            let spec = lifecycle_layout::ModelConfig::from_file(path)?.model_spec(128);
            (spec, spec.moe.is_some(), path.display().to_string())
        }
        None if args.model == "qwen3-30b-a3b" => (
            ModelSpec::qwen3_30b_a3b(args.layers),
            true,
            "Qwen3-30B-A3B".to_string(),
        ),
        None => (
            ModelSpec::qwen2_5_7b(args.layers),
            false,
            "Qwen2.5-7B".to_string(),
        ),
    };
    let params: usize = model
        .hf_tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    println!(
        "model: {shapes} shapes, {} layers, {:.3} B parameters{}",
        model.layers,
        params as f64 / 1e9,
        if moe {
            format!(
                "; experts EP {} x expert TP = TP, rollout experts {}",
                args.ep,
                args.experts.name()
            )
        } else {
            String::new()
        }
    );
    // expert parallelism needs expert data-parallel ranks: TP1/PP1 with DP = W then
    let expert_parallel = moe && args.ep > 1;
    let (layouts, skipped): (Vec<_>, Vec<_>) = LAYOUTS
        .into_iter()
        .partition(|&(tp, pp)| tp * pp == if expert_parallel { 1 } else { world });
    if !skipped.is_empty() {
        println!(
            "training layouts skipped at W = {world} (TP × PP must equal W; 1 with --ep > 1): {}",
            skipped
                .iter()
                .map(|(tp, pp)| format!("TP{tp}/PP{pp}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let (rollouts, skipped): (Vec<_>, Vec<_>) = ROLLOUT_TP
        .into_iter()
        .partition(|&t| world.is_multiple_of(t));
    if !skipped.is_empty() {
        println!(
            "rollout T skipped at W = {world} (T must divide W): {}",
            skipped
                .iter()
                .map(|t| format!("T={t}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let pinned = Arc::new(PinnedPool::default());
    let mut rows: Vec<Row> = Vec::new();
    let mut offload_rows: Vec<Row> = Vec::new();
    for (tp, pp) in layouts {
        let dp = world / (tp * pp);
        let layout = MegatronLayout::new_moe(model, tp, pp, dp, args.ep, tp)?;
        let lname = if dp > 1 {
            format!("TP{tp}/PP{pp}/DP{dp}/EP{}", args.ep)
        } else {
            format!("TP{tp}/PP{pp}")
        };
        let t0 = Instant::now();
        let mut state = MegatronGpuBackend::new(
            pool.clone(),
            RolloutLayout::fused(1, RolloutVocab::Unpadded).with_expert_placement(args.experts),
        )?
        .synthetic_state(layout, 1234, 0.02)?;
        println!(
            "\n{lname}: synthetic state made on the GPUs in {:.2} s; per rank {:.2} GB of training state",
            t0.elapsed().as_secs_f64(),
            state.rank_bytes(0).unwrap_or(0) as f64 / GB
        );
        for &t in &rollouts {
            let rollout =
                RolloutLayout::fused(t, RolloutVocab::Unpadded).with_expert_placement(args.experts);
            let mut backend =
                MegatronGpuBackend::new(pool.clone(), rollout)?.with_pinned_pool(pinned.clone());
            let plan = backend.plan(&state)?;
            let mut floor: f64 = 0.0;
            let (mut max_recv, mut local_floor) = (0usize, 0.0f64);
            for r in 0..world {
                let Some(s) = plan.schedule(r) else { continue };
                let (recv, sent, local) = (s.recv_elems * 2, s.send_elems * 2, s.local_elems * 2);
                let f_net = net_floor(recv, c.link);
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
                let mut lc = lazy_lifecycle(backend, state, MemoryPolicy::resident())?;
                let (en, ex) = time_cycles(&mut lc, args.iters, true)?;
                let m = lc.metrics().clone();
                let tr = m.phase(Phase::Transfer);
                let msgs = plan_messages(&lc)?;
                let peer = lc.backend().plan(lc.peek_state())?.peer_copy();
                println!(
                    "  T={t} resident, {}, bucket {:>4} MiB x {}, direct >= {}, memcpy >= {}, peer tiles < {}, split bulk {}, {} blocks/SM: {}; {msgs}; received {:.3} GB per switch (all ranks), peak staging {:.0} MB",
                    if peer { "peer copies" } else { "NCCL steps " },
                    cfg.bucket_bytes >> 20,
                    cfg.in_flight,
                    mib(cfg.direct_min_bytes),
                    mib(cfg.memcpy_min_bytes),
                    mib(cfg.peer_tile_max_bytes),
                    cfg.split_local_bulk,
                    cfg.overlap_blocks_per_sm,
                    resident_times(en, ex, &m),
                    phase_d2d_bytes(&m, Phase::Transfer) / GB,
                    tr.peak_extra_bytes as f64 / 1e6
                );
                if en < best.0 {
                    best = (en, cfg, peer);
                }
                let (b, s) = lc.into_parts()?;
                backend = b;
                state = s;
            }
            if args.fp8 {
                let (b, s, row) = fp8_enter(
                    backend,
                    state,
                    best.1,
                    (&c, world),
                    args.iters,
                    (&lname, t),
                    args.trace.as_deref(),
                )?;
                backend = b;
                state = s;
                rows.push(row);
            }
            let trace_name = format!("megatron_tp{tp}_pp{pp}_t{t}");
            if let (Some(dir), false) = (&args.trace, !args.skip_offload) {
                backend = backend.with_config(best.1)?;
                let mut lc = lazy_lifecycle(backend, state, MemoryPolicy::resident())?;
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
                    format!("{lname} -> T={t} enter (peer copies)")
                } else {
                    format!(
                        "{lname} -> T={t} enter ({} MiB x {}, direct {})",
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
            if !args.skip_offload {
                backend = backend.with_config(best.1)?;
                let t1 = Instant::now();
                let cached = backend.reserve_pinned(&state, MemoryPolicy::default())?;
                println!(
                    "  pinned host memory for the offload: {:.1} GB cached for {} ({:.1} s to reserve)",
                    cached as f64 / GB,
                    all_ranks(world),
                    t1.elapsed().as_secs_f64()
                );
                let bytes = (0..world)
                    .filter_map(|r| state.offload_bytes(r))
                    .map(|(p, o)| (p + o) as f64)
                    .fold(0.0, f64::max);
                let mut lc = lazy_lifecycle(backend, state, MemoryPolicy::default())?;
                let (en, ex) = time_cycles(&mut lc, args.offload_iters, false)?;
                let m = lc.metrics().clone();
                println!(
                    "  T={t} offload params + main + Adam ({:.1} GB/rank): {}",
                    bytes / GB,
                    offload_times(en, ex, &m)
                );
                offload_rows.push(Row {
                    what: format!("{lname} -> T={t} enter with offload"),
                    ours: en,
                    floor: bytes / c.d2h,
                    floor_sr: None,
                });
                offload_rows.push(Row {
                    what: format!("{lname} -> T={t} exit with reload"),
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
    println!("\nSUMMARY (W = {world}, ceilings measured above in this process)");
    for l in &c.lines {
        println!("  {l}");
    }
    println!(
        "  link rate used for floors: {} (best of the NCCL figures); d2d {:.0} GB/s",
        gbps(c.link, 1, NO_LINK),
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
            "  {:<46} {:>10} {:>10} {:>8} {:>5}{sr}",
            r.what,
            ms(r.ours),
            ms(r.floor),
            ratio(r.ours, r.floor).map_or("n/a (floor 0)".to_string(), |x| format!("{x:.2}x")),
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
    use lifecycle_bench::cli::{assert_parses, assert_refused};

    #[test]
    fn documented_command_lines() {
        let [d, one, traced, short] = assert_parses::<Cli, 4>([
            "",
            "--world 1 --skip-offload",
            "--skip-offload --trace /tmp/t",
            "--layers 2 --iters 3 --offload-iters 1",
        ]);
        assert_eq!((d.layers, d.iters, d.offload_iters, d.world), (28, 5, 2, 2));
        assert!(!d.skip_offload && d.trace.is_none());
        assert!(one.skip_offload && one.world == 1);
        assert_eq!(traced.trace, Some(PathBuf::from("/tmp/t")));
        assert_eq!((short.layers, short.iters, short.offload_iters), (2, 3, 1));
        assert_refused::<Cli>(&[
            "--layers 0",
            "--iters 0",
            "--offload-iters 0",
            "--world 0",
            "--bogus",
        ]);
    }

    #[test]
    fn layouts_and_rollout_degrees_per_world() {
        let layouts = |w: usize| -> Vec<(usize, usize)> {
            LAYOUTS
                .into_iter()
                .filter(|(tp, pp)| tp * pp == w)
                .collect()
        };
        assert_eq!(layouts(1), [(1, 1)]);
        assert_eq!(layouts(2), [(2, 1), (1, 2)]);
        let ts = |w: usize| -> Vec<usize> {
            ROLLOUT_TP
                .into_iter()
                .filter(|&t| w.is_multiple_of(t))
                .collect()
        };
        assert_eq!(ts(1), [1]);
        assert_eq!(ts(2), [1, 2]);
    }

    #[test]
    fn floors_and_report_text_without_a_link() {
        assert_eq!(net_floor(0, None), 0.0);
        assert_eq!(net_floor(0, Some(1e9)), 0.0);
        assert_eq!(net_floor(2_000_000_000, Some(1e9)), 2.0);
        assert_eq!(net_floor(1, None), f64::INFINITY);
        assert_eq!(all_gpus(2), "both GPUs at once");
        assert_eq!(all_gpus(1), "one GPU");
        assert_eq!(all_ranks(2), "both ranks");
        assert_eq!(all_ranks(4), "all 4 ranks");
    }
}
