//! `lifecycle-plan`: the transfer plan of a switch per rank and its predicted cost.
//!
//! ```text
//! lifecycle-plan --config plan/configs/qwen2.5-7b.json --train fsdp:2 --rollout-tp 2
//! lifecycle-plan --config config.json --train megatron:tp=2,pp=1,dp=1 --rollout-tp 1 --rates rates.json
//! lifecycle-plan --config plan/configs/qwen3-30b-a3b.json --train fsdp:16 --rollout-tp 8 --experts ep
//! ```

use lifecycle_layout::fp8::Fp8Keep;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use lifecycle_core::{HumanBytes, MemoryPolicy, RoomRequest};
use lifecycle_layout::ExpertPlacement;
use lifecycle_layout::ModelConfig;
use lifecycle_plan::{
    full_gather_bytes, job_prediction, megatron_fp8_bytes, megatron_fp8_switch, plan_fsdp_experts,
    plan_fsdp_fp8, plan_megatron_moe, rollout_memory, KvDtype, LinkRates, MegatronFp8Switch,
    Offload, RankCost, RatesSource, TrainLayout,
};

/// Print a switch's transfer plan per rank and predict its time, before launching.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The model's Hugging Face config.json.
    #[arg(long)]
    config: PathBuf,
    /// Training layout: `fsdp:W` or `megatron:tp=N,pp=N,dp=N` (degrees left out are 1, and
    /// said so in the output).
    #[arg(long = "train", value_name = "LAYOUT")]
    train_spec: String,
    /// Rollout tensor-parallel degree T (divides the world size).
    #[arg(long)]
    rollout_tp: usize,
    /// Mixture-of-experts models: `tp` splits every expert by tensor parallelism, `ep`
    /// partitions the experts over the T rollout ranks (each receives only its own experts).
    #[arg(long, default_value = "tp", value_parser = <ExpertPlacement as std::str::FromStr>::from_str)]
    experts: ExpertPlacement,
    /// Rollout weight format: `bf16`, or `fp8` (block-scaled e4m3, 128 x 128 blocks; embeddings,
    /// head, norms and router stay bf16) to see what each rank would hold and receive (FSDP).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "fp8"])]
    rollout_dtype: String,
    /// Bucket byte budget, MiB.
    #[arg(long, default_value_t = 256)]
    bucket_mib: u64,
    /// Buckets in flight (FSDP).
    #[arg(long, default_value_t = 2)]
    in_flight: usize,
    /// fp8: matrices kept bf16 beyond the embedding, head, norms and router: a comma-separated
    /// list of `attention` and `layer:N`, or `none`.
    #[arg(long, default_value = "none", value_parser = <Fp8Keep as std::str::FromStr>::from_str)]
    fp8_keep: Fp8Keep,
    /// The rollout engine's KV cache dtype for the memory accounting: `bf16` (vLLM's default),
    /// `f32` (the project's GPU decoder today) or `fp8`.
    #[arg(long, default_value = "bf16", value_parser = <KvDtype as std::str::FromStr>::from_str)]
    kv_dtype: KvDtype,
    /// GPUs per node, for the pinned host memory a node needs.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: usize,
    /// Device memory per GPU, GiB, for the memory accounting (the H200's 139 by default).
    #[arg(long, default_value_t = 139.0)]
    device_gib: f64,
    /// What is offloaded during rollout: `need` (the default, as the GPU runs decide it: the
    /// least that leaves room for `--kv-tokens`), `all`, `params`, `optimizer` or `none`.
    #[arg(long, default_value = "need")]
    offload: String,
    /// KV-cache tokens (summed over the sequences) the rollout asks for: the by-need line
    /// says what a switch must offload to make room for them.
    #[arg(long, default_value_t = 65536)]
    kv_tokens: u64,
    /// Megatron's --make-vocab-size-divisible-by.
    #[arg(long, default_value_t = 128)]
    make_vocab_size_divisible_by: usize,
    /// Rates of a previous run (JSON; see `LinkRates::from_json`).
    #[arg(long)]
    rates: Option<PathBuf>,
    /// Device↔device receive rate per rank, GB/s.
    #[arg(long)]
    nvlink_gbps: Option<f64>,
    /// Device memory rate for local casts and copies, GB/s.
    #[arg(long)]
    hbm_gbps: Option<f64>,
    /// Pinned host → device rate, GB/s.
    #[arg(long)]
    h2d_gbps: Option<f64>,
    /// Device → pinned host rate, GB/s.
    #[arg(long)]
    d2h_gbps: Option<f64>,
}

fn rates(args: &Args) -> Result<(LinkRates, RatesSource), String> {
    let (mut r, mut source) = match &args.rates {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the rates file {}: {e}", path.display()))?;
            (
                LinkRates::from_json(&text)?,
                RatesSource::File(path.display().to_string()),
            )
        }
        None => (LinkRates::default(), RatesSource::Defaults),
    };
    for (given, field, name) in [
        (
            args.nvlink_gbps,
            &mut r.nvlink_gbps as &mut f64,
            "--nvlink-gbps",
        ),
        (args.hbm_gbps, &mut r.hbm_gbps, "--hbm-gbps"),
        (args.h2d_gbps, &mut r.h2d_gbps, "--h2d-gbps"),
        (args.d2h_gbps, &mut r.d2h_gbps, "--d2h-gbps"),
    ] {
        if let Some(g) = given {
            if !(g > 0.0 && g.is_finite()) {
                return Err(format!("{name} must be a positive number, found {g}"));
            }
            *field = g;
            source = RatesSource::Options;
        }
    }
    Ok((r, source))
}

/// `--offload`: a class of buffers, or `None` for by need.
fn offload(s: &str) -> Result<Option<Offload>, String> {
    Ok(Some(match s {
        "need" => return Ok(None),
        "all" => Offload::ALL,
        "none" => Offload::NONE,
        "params" => Offload {
            params: true,
            optimizer: false,
        },
        "optimizer" => Offload {
            params: false,
            optimizer: true,
        },
        other => {
            return Err(format!(
                "--offload `{other}`: expected need, all, params, optimizer or none"
            ))
        }
    }))
}

fn ms(s: f64) -> String {
    if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.3} s")
    }
}

fn print(ranks: &[RankCost], rates: &LinkRates) {
    println!(
        "{:>4} {:>10} {:>10} {:>12} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "rank",
        "rollout",
        "recv d2d",
        "local traf.",
        "buckets",
        "peak extra",
        "offload",
        "reload",
        "transfer",
        "enter",
        "exit"
    );
    for r in ranks {
        let p = r.predict(rates);
        println!(
            "{:>4} {:>10} {:>10} {:>12} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            r.rank,
            HumanBytes(r.rollout_bytes).to_string(),
            HumanBytes(r.recv_bytes).to_string(),
            HumanBytes(r.local_traffic_bytes).to_string(),
            r.buckets,
            HumanBytes(r.peak_extra_bytes).to_string(),
            HumanBytes(r.offload_bytes).to_string(),
            HumanBytes(r.reload_bytes).to_string(),
            ms(p.transfer_s),
            ms(p.enter_s),
            ms(p.exit_s),
        );
    }
}

/// The pinned host memory the offload needs: per rank and per node (ranks `n * gpus .. (n + 1) *
/// gpus` on node `n`, as torchrun and Slurm place them).
fn print_pinned(ranks: &[RankCost], gpus_per_node: usize) {
    let most_rank = ranks.iter().map(|r| r.offload_bytes).max().unwrap_or(0);
    if most_rank == 0 {
        println!("pinned host memory: none (nothing is offloaded)");
        return;
    }
    let mut nodes: Vec<u64> = Vec::new();
    for r in ranks {
        let n = r.rank / gpus_per_node;
        if nodes.len() <= n {
            nodes.resize(n + 1, 0);
        }
        nodes[n] += r.offload_bytes;
    }
    let (node, most_node) = nodes
        .iter()
        .copied()
        .enumerate()
        .max_by_key(|&(_, b)| b)
        .unwrap_or((0, 0));
    println!(
        "pinned host memory: at most {} per rank, {} on node {node} ({} GPUs per node, {} \
         node(s); --gpus-per-node)",
        HumanBytes(most_rank),
        HumanBytes(most_node),
        gpus_per_node,
        nodes.len()
    );
}

/// The fp8 rollout's plan of `--rollout-dtype fp8`: what each rank would hold and receive (and
/// on Megatron layouts how the switch writes it), printed; the bytes each rank holds (empty for
/// bf16) and the bf16 staging a switch needs per rank beside them (0 but for a staged Megatron
/// fp8 switch).
fn print_fp8(
    args: &Args,
    config: &ModelConfig,
    train: TrainLayout,
) -> Result<(Vec<u64>, u64), String> {
    let mut fp8_held: Vec<u64> = Vec::new();
    if args.rollout_dtype == "fp8" {
        let world = match train {
            TrainLayout::Fsdp { world } => world,
            TrainLayout::Megatron {
                tp,
                pp,
                dp,
                ep,
                etp,
            } => {
                let (fp8, bf16) = megatron_fp8_bytes(
                    config,
                    args.rollout_tp,
                    args.experts,
                    args.fp8_keep,
                    args.make_vocab_size_divisible_by,
                )
                .map_err(|e| e.to_string())?;
                let switch = megatron_fp8_switch(
                    config,
                    (tp, pp, dp),
                    (ep, etp),
                    (args.rollout_tp, args.experts),
                    args.fp8_keep,
                    args.make_vocab_size_divisible_by,
                    args.bucket_mib.max(1) << 20,
                )
                .map_err(|e| e.to_string())?;
                let (design, staging) = match switch {
                    MegatronFp8Switch::OneRead => (
                        "quantising straight from the bf16 parameters (every rank holds its \
                         rows: no staging)"
                            .to_string(),
                        0,
                    ),
                    MegatronFp8Switch::Staged { staging_bytes } => (
                        format!(
                            "staging the bf16 rollout ({} per rank, rows from peers) beside it \
                             during a switch",
                            HumanBytes(staging_bytes)
                        ),
                        staging_bytes,
                    ),
                };
                println!(
                    "fp8 rollout of the fused layout (each fused matrix quantised in its own \
                     128 x 128 grid from the bf16 parameters, fp32 scales; embeddings, head, \
                     norms and router bf16; also kept bf16: {}): per rank holds {} (bf16: {}); \
                     the host and GPU backends run it, the GPU one {design}",
                    args.fp8_keep,
                    HumanBytes(fp8),
                    HumanBytes(bf16)
                );
                return Ok((vec![fp8; tp * pp * dp], staging));
            }
        };
        let fp8 = plan_fsdp_fp8(config, world, args.rollout_tp, args.experts, args.fp8_keep)
            .map_err(|e| e.to_string())?;
        let most =
            |f: fn(&lifecycle_layout::fp8::Fp8Traffic) -> u64| fp8.iter().map(f).max().unwrap_or(0);
        fp8_held = fp8.iter().map(|t| t.rollout_bytes).collect();
        let shared: u64 = fp8.iter().map(|t| t.shared_blocks).sum();
        let amax: u64 = fp8.iter().map(|t| t.amax_bytes).sum();
        println!(
            "fp8 rollout (block-scaled e4m3, 128 x 128 blocks, fp32 scales; embeddings, head, \
             norms and router bf16; also kept bf16: {}): per rank holds at most {} (bf16: {}) and receives at most \
             {} (bf16: {}); {shared} scale blocks span FSDP shards, agreed by {} of amax messages \
             before quantising (not timed by the prediction)",
            args.fp8_keep,
            HumanBytes(most(|t| t.rollout_bytes)),
            HumanBytes(most(|t| t.rollout_bytes_bf16)),
            HumanBytes(most(|t| t.recv_bytes)),
            HumanBytes(most(|t| t.recv_bytes_bf16)),
            HumanBytes(amax),
        );
    }
    Ok((fp8_held, 0))
}

/// The device memory during rollout of the rank holding the most rollout weights (`fp8_held`:
/// what each rank holds in an fp8 rollout, empty for bf16; `fp8_staging`: the bf16 staging of a
/// staged fp8 switch, part of the staging peak).
fn print_memory(
    args: &Args,
    config: &ModelConfig,
    ranks: &[RankCost],
    (fp8_held, fp8_staging): (&[u64], u64),
) {
    // the memory of the rank holding the most rollout weights
    if let Some(r) = ranks.iter().max_by_key(|r| r.rollout_bytes) {
        let device = (args.device_gib * (1u64 << 30) as f64) as u64;
        let fp8_held = fp8_held.get(r.rank).copied();
        let m = rollout_memory(
            config,
            args.rollout_tp,
            r,
            fp8_held.unwrap_or(r.rollout_bytes),
            device,
            args.kv_dtype,
        );
        let share = |b: u64| 100.0 * b as f64 / device.max(1) as f64;
        println!(
            "memory of rank {} during rollout ({:.0} GiB device): training state kept {} \
             ({:.0}%), rollout weights {} in {} ({:.0}%), staging peak {} (freed after enter), \
             KV cache room {} ({:.0}%) = {} tokens at {} per token ({} K and V of its {} \
             layers; --kv-dtype)",
            r.rank,
            args.device_gib,
            HumanBytes(m.train_resident_bytes),
            share(m.train_resident_bytes),
            HumanBytes(m.rollout_bytes),
            args.rollout_dtype,
            share(m.rollout_bytes),
            HumanBytes(m.staging_bytes + fp8_staging),
            HumanBytes(m.kv_room()),
            share(m.kv_room()),
            m.kv_tokens(),
            HumanBytes(m.kv_bytes_per_token),
            args.kv_dtype,
            config.model.layers,
        );
        if fp8_held.is_some() {
            let bf16 = rollout_memory(
                config,
                args.rollout_tp,
                r,
                r.rollout_bytes,
                device,
                args.kv_dtype,
            );
            println!(
                "  (bf16 rollout weights would leave {} tokens: fp8 adds {:.0}%)",
                bf16.kv_tokens(),
                100.0 * (m.kv_tokens() as f64 / bf16.kv_tokens().max(1) as f64 - 1.0)
            );
        }
        println!(
            "  the engine's paged KV cache can take them all, shared by any number of sequences: \
             EngineSettings::with_kv_tokens(N) (Python: Engine(..., kv_tokens=N)) with N up to {} \
             less ~1 GiB ({} tokens) for a pass's activations and logits",
            m.kv_tokens(),
            (1u64 << 30) / m.kv_bytes_per_token.max(1)
        );
    }
}

/// What offload by need chooses for `--kv-tokens` on the rank holding the most rollout weights:
/// from the training state it keeps with nothing offloaded (`none`) and what the parameters
/// (`params`) and the optimizer state (`optimizer`) alone would move.
fn print_by_need(
    args: &Args,
    config: &ModelConfig,
    fp8_held: &[u64],
    (none, params, optimizer): (&[RankCost], &[RankCost], &[RankCost]),
) -> Option<Offload> {
    let r = none.iter().max_by_key(|r| r.rollout_bytes)?;
    let device = (args.device_gib * (1u64 << 30) as f64) as u64;
    let rollout = fp8_held.get(r.rank).copied().unwrap_or(r.rollout_bytes);
    let m = rollout_memory(config, args.rollout_tp, r, rollout, device, args.kv_dtype);
    let at = |v: &[RankCost]| v.get(r.rank).map_or(0, |c| c.offload_bytes);
    let kept = r.train_state_bytes;
    let request = RoomRequest {
        free: device.saturating_sub(kept),
        rollout,
        staging: r.peak_extra_bytes,
        engine: args.kv_tokens * m.kv_bytes_per_token,
        margin: 2 << 30,
        grads: 0,
        optimizer: at(optimizer),
        params: at(params),
    };
    match MemoryPolicy::by_need(&request) {
        Ok(d) => {
            println!("offload for {} KV tokens, {d}", args.kv_tokens);
            Some(Offload {
                params: d.policy.offload_params,
                optimizer: d.policy.offload_optimizer,
            })
        }
        Err(e) => {
            println!(
                "offload by need for {} KV tokens: does not fit: {e}",
                args.kv_tokens
            );
            None
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let config = ModelConfig::from_file(&args.config).map_err(|e| e.to_string())?;
    let (rates, source) = rates(args)?;
    let offload = offload(&args.offload)?;
    let bucket = args.bucket_mib.max(1) << 20;
    let train: TrainLayout = args.train_spec.parse()?;
    if args.gpus_per_node == 0 {
        return Err("--gpus-per-node must be at least 1".into());
    }
    // before anything prints: a kept layer the model lacks
    let shapes = config.tensor_shapes();
    args.fp8_keep
        .check_layers(shapes.iter().map(|(n, _)| n.as_str()))
        .map_err(|e| e.to_string())?;
    let plan_for = |offload: Offload| {
        match train {
            TrainLayout::Fsdp { world } => plan_fsdp_experts(
                &config,
                world,
                args.rollout_tp,
                bucket,
                args.in_flight,
                offload,
                args.experts,
            ),
            TrainLayout::Megatron {
                tp,
                pp,
                dp,
                ep,
                etp,
            } => plan_megatron_moe(
                &config,
                (tp, pp, dp),
                (ep, etp),
                (args.rollout_tp, args.experts),
                args.make_vocab_size_divisible_by,
                bucket,
                offload,
            ),
        }
        .map_err(|e| e.to_string())
    };
    // the plans with nothing, the parameters alone and the optimizer state alone offloaded:
    // what offload by need weighs
    let classes = (
        plan_for(Offload::NONE)?,
        plan_for(Offload {
            params: true,
            optimizer: false,
        })?,
        plan_for(Offload {
            params: false,
            optimizer: true,
        })?,
    );
    println!(
        "model {} ({:.3} B params); training {}; rollout T = {}; buckets of {} MiB; offload {}",
        args.config.display(),
        config.params() as f64 / 1e9,
        train,
        args.rollout_tp,
        args.bucket_mib,
        match offload {
            Some(_) => args.offload.clone(),
            None => format!("by need for {} KV tokens", args.kv_tokens),
        }
    );
    let defaulted = TrainLayout::defaulted(&args.train_spec);
    if !defaulted.is_empty() {
        println!(
            "training layout `{}` leaves out {}: taken as {train} ({} ranks)",
            args.train_spec,
            defaulted.join(", "),
            train.world()
        );
    }
    if let Some(m) = config.model.moe {
        println!(
            "mixture of experts: {} experts of {} per layer, top-{}; experts {}",
            m.experts,
            m.ffn,
            m.top_k,
            match args.experts {
                ExpertPlacement::TensorParallel => "split by TP inside every expert",
                ExpertPlacement::Partitioned => "partitioned over the rollout ranks (EP = T)",
            }
        );
    }
    let (fp8_held, fp8_staging) = print_fp8(args, &config, train)?;
    let needed = print_by_need(
        args,
        &config,
        &fp8_held,
        (&classes.0, &classes.1, &classes.2),
    );
    let offload = match (offload, needed) {
        (Some(o), _) => o,
        (None, Some(o)) => o,
        (None, None) => {
            println!("(the rest as with everything offloaded)");
            Offload::ALL
        }
    };
    let ranks = if offload == Offload::NONE {
        classes.0
    } else {
        plan_for(offload)?
    };
    print(&ranks, &rates);
    let full = full_gather_bytes(&config);
    let most_recv = ranks.iter().map(|r| r.recv_bytes).max().unwrap_or(0);
    let most_held = ranks.iter().map(|r| r.rollout_bytes).max().unwrap_or(0);
    let gathered = full - full / ranks.len().max(1) as u64;
    let receives = if most_recv == 0 {
        "nothing from its peers (every rank holds what it rolls out)".to_string()
    } else {
        format!(
            "at most {} per rank ({:.1}x less)",
            HumanBytes(most_recv),
            gathered as f64 / most_recv as f64
        )
    };
    println!(
        "against a full gather (every rank materialises the whole model, {}, receiving {} of it): \
         this plan receives {receives} and holds at most {}",
        HumanBytes(full),
        HumanBytes(gathered),
        HumanBytes(most_held),
    );
    print_memory(args, &config, &ranks, (&fp8_held, fp8_staging));
    print_pinned(&ranks, args.gpus_per_node);
    let p = job_prediction(&ranks, &rates);
    println!(
        "predicted (slowest rank): transfer {}, enter {}, exit {}, full switch {}",
        ms(p.transfer_s),
        ms(p.enter_s),
        ms(p.exit_s),
        ms(p.switch_s())
    );
    if p.offload_s > 0.0 {
        println!(
            "with the offload overlapped with the rollout (the GPU DAPO runs' default, \
             with_offload_overlap on either GPU backend): the rollout starts after the transfer ({}) \
             instead of the enter ({}); the copies ({}) go on beside it and exit joins them",
            ms(p.transfer_s),
            ms(p.enter_s),
            ms(p.offload_s)
        );
    }
    let from = match source {
        RatesSource::Defaults => "the 2×H200 defaults".to_string(),
        RatesSource::File(f) => format!("file {f}"),
        RatesSource::Options => "options".to_string(),
    };
    println!(
        "rates ({from}): device-device {:.0} GB/s, device memory {:.0} GB/s, host->device {:.1} GB/s, device->host {:.1} GB/s",
        rates.nvlink_gbps, rates.hbm_gbps, rates.h2d_gbps, rates.d2h_gbps
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
