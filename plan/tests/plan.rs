//! The plan command on the CPU: byte counts of the 7.6B-shaped model's plans agree with what the
//! backends move (BENCHMARKS.md), predictions follow the model, bad input is a clear error.

use std::process::Command;

use lifecycle_layout::ModelConfig;
use lifecycle_plan::{job_prediction, plan_fsdp, plan_megatron, LinkRates, Offload, TrainLayout};

fn qwen7b() -> ModelConfig {
    ModelConfig::from_json_str(include_str!("../configs/qwen2.5-7b.json")).unwrap()
}

const GB: f64 = 1e9;

#[test]
fn fsdp_plans_match_the_bytes_the_gpu_backend_moves() {
    let c = qwen7b();
    // measured by fsdp_bench: T = 1 receives 7.616 GB per rank, T = 2 1.131 GB; 8 buckets at T = 2
    // (the first three ramp up to the budget)
    let t1 = plan_fsdp(&c, 2, 1, 4 << 30, 2, Offload::NONE).unwrap();
    assert!(
        (t1[0].recv_bytes as f64 / GB - 7.616).abs() < 0.001,
        "{}",
        t1[0].recv_bytes
    );
    assert_eq!(t1[0].peak_extra_bytes, 0, "T = 1 stages nothing");
    let t2 = plan_fsdp(&c, 2, 2, 256 << 20, 2, Offload::ALL).unwrap();
    assert!(
        (t2[1].recv_bytes as f64 / GB - 1.131).abs() < 0.001,
        "{}",
        t2[1].recv_bytes
    );
    assert_eq!(t2[0].buckets, 8);
    assert!(
        (t2[0].peak_extra_bytes as f64 / 1e6 - 484.5).abs() < 0.1,
        "{}",
        t2[0].peak_extra_bytes
    );
    // master + Adam m, v of one rank: 3 x 4 B x half the parameters (padded)
    assert!((t2[0].offload_bytes as f64 / GB - 45.69).abs() < 0.01);
    let p = job_prediction(&t2, &LinkRates::default());
    assert!(
        (p.enter_s - 45.69 / 55.0).abs() < 0.01,
        "offload-bound enter: {p:?}"
    );
    assert!((p.switch_s() - 2.0 * 45.69 / 55.0).abs() < 0.02);
}

#[test]
fn megatron_plans_follow_the_layouts() {
    let c = qwen7b();
    // T = TP, PP = 1: every rank holds its own slice
    let same = plan_megatron(&c, 2, 1, 1, 2, 128, 256 << 20, Offload::NONE).unwrap();
    assert!(same.iter().all(|r| r.recv_bytes == 0));
    // TP 1 / PP 2 -> T = 1: each rank receives the other stage's layers
    let pp = plan_megatron(&c, 1, 2, 1, 1, 128, 256 << 20, Offload::NONE).unwrap();
    let total: u64 = pp.iter().map(|r| r.recv_bytes).sum();
    assert!((total as f64 / GB - 15.23).abs() < 0.01, "{total}");
    // DP replicas: offload per rank shrinks with DP (distributed optimizer)
    let dp1 = plan_megatron(&c, 2, 1, 1, 2, 128, 256 << 20, Offload::ALL).unwrap();
    let dp2 = plan_megatron(&c, 2, 1, 2, 2, 128, 256 << 20, Offload::ALL).unwrap();
    assert!(dp2[0].offload_bytes < dp1[0].offload_bytes);
}

#[test]
fn predictions_take_the_slower_of_network_and_memory() {
    let c = qwen7b();
    let t2 = plan_fsdp(&c, 2, 2, 256 << 20, 2, Offload::NONE).unwrap();
    let fast_net = LinkRates {
        nvlink_gbps: 1e6,
        ..LinkRates::default()
    };
    let p = t2[0].predict(&fast_net);
    assert!((p.transfer_s - t2[0].local_traffic_bytes as f64 / 4100e9).abs() < 1e-9);
    let slow_net = LinkRates {
        nvlink_gbps: 1.0,
        ..LinkRates::default()
    };
    assert!((t2[0].predict(&slow_net).transfer_s - t2[0].recv_bytes as f64 / 1e9).abs() < 1e-9);
}

#[test]
fn bad_input_names_the_problem() {
    let c = qwen7b();
    let err = plan_fsdp(&c, 4, 3, 256 << 20, 2, Offload::ALL)
        .unwrap_err()
        .to_string();
    assert!(err.contains('3'), "{err}");
    let err = plan_megatron(&c, 3, 1, 1, 1, 128, 256 << 20, Offload::ALL)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not divisible by the training TP"), "{err}");
    let err = "megatron:pp=2".parse::<TrainLayout>().unwrap_err();
    assert!(err.contains("tp is missing"), "{err}");
    let err = "fsdp:0".parse::<TrainLayout>().unwrap_err();
    assert!(err.contains("positive integer"), "{err}");
    let err = LinkRates::from_json(r#"{"h2d_gbps": -1}"#).unwrap_err();
    assert!(err.contains("h2d_gbps"), "{err}");
}

#[test]
fn the_command_prints_a_plan_and_a_prediction() {
    let bin = env!("CARGO_BIN_EXE_lifecycle-plan");
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/qwen2.5-7b.json");
    let dir = std::env::temp_dir().join(format!("lifecycle-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rates = dir.join("rates.json");
    std::fs::write(
        &rates,
        LinkRates {
            h2d_gbps: 25.0,
            ..LinkRates::default()
        }
        .to_json(),
    )
    .unwrap();
    let out = Command::new(bin)
        .args([
            "--config",
            config,
            "--train",
            "fsdp:2",
            "--rollout-tp",
            "2",
            "--rates",
        ])
        .arg(&rates)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("training fsdp:2"), "{text}");
    assert!(text.contains("1.13 GB"), "{text}");
    assert!(text.contains("host->device 25.0 GB/s"), "{text}");
    assert!(text.contains("full switch"), "{text}");
    let out = Command::new(bin)
        .args([
            "--config",
            config,
            "--train",
            "megatron:tp=3",
            "--rollout-tp",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("pick a degree dividing 28"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_32b_shape_at_eight_ranks_receives_a_fraction_of_a_full_gather() {
    let c = ModelConfig::from_json_str(include_str!("../configs/qwen2.5-32b.json")).unwrap();
    let full = 2.0 * c.params() as f64 * 7.0 / 8.0;
    // T = 8 on FSDP W = 8: each rank receives 2.35 GB instead of 57.3 GB of a full gather.
    let t8 = plan_fsdp(&c, 8, 8, 256 << 20, 2, Offload::NONE).unwrap();
    let most = t8.iter().map(|r| r.recv_bytes).max().unwrap() as f64;
    assert!((most / GB - 2.35).abs() < 0.01, "{}", most / GB);
    assert!(most / full < 0.05);
    // T = 1 is a full gather by construction.
    let t1 = plan_fsdp(&c, 8, 1, 4 << 30, 2, Offload::NONE).unwrap();
    assert!((t1[0].recv_bytes as f64 - full).abs() / full < 1e-3);
}

/// Qwen3-30B-A3B at `layers` layers (its published config, reduced in depth for debug builds).
fn qwen3_30b(layers: usize) -> ModelConfig {
    let text = include_str!("../configs/qwen3-30b-a3b.json").replace(
        "\"num_hidden_layers\": 48",
        &format!("\"num_hidden_layers\": {layers}"),
    );
    ModelConfig::from_json_str(&text).unwrap()
}

#[test]
fn moe_plans_receive_only_each_ranks_experts() {
    use lifecycle_layout::ExpertPlacement::{Partitioned, TensorParallel};
    use lifecycle_plan::{full_gather_bytes, plan_fsdp_experts};
    let c = qwen3_30b(2);
    let m = c.model.moe.unwrap();
    let expert_bytes = (2 * m.experts * 3 * m.ffn * c.model.hidden * 2) as u64; // 2 layers, bf16
    let full = full_gather_bytes(&c);
    let other = full - expert_bytes;
    for (w, t) in [(8, 8), (16, 8), (64, 8)] {
        let ep = plan_fsdp_experts(&c, w, t, 256 << 20, 2, Offload::NONE, Partitioned).unwrap();
        let tp = plan_fsdp_experts(&c, w, t, 256 << 20, 2, Offload::NONE, TensorParallel).unwrap();
        for (e, p) in ep.iter().zip(&tp) {
            // either way a rank holds 1/T of the experts; EP holds them whole
            assert_eq!(e.rollout_bytes, p.rollout_bytes, "W={w} T={t}");
            // the experts' share of what it holds is exactly E/T experts, nothing of the rest
            let dense_share = p.rollout_bytes - expert_bytes / t as u64;
            assert!(dense_share < other, "W={w} T={t}");
            // never more than what a rank holds; a full gather would move the whole model
            assert!(e.recv_bytes <= e.rollout_bytes && e.recv_bytes * 7 < full);
        }
    }
    // W = T: FSDP shards every expert's rows over all ranks, so TP inside each expert finds
    // its slice local while EP gathers 7/8 of each whole expert from the peers
    let ep = plan_fsdp_experts(&c, 8, 8, 256 << 20, 2, Offload::NONE, Partitioned).unwrap();
    let tp = plan_fsdp_experts(&c, 8, 8, 256 << 20, 2, Offload::NONE, TensorParallel).unwrap();
    assert!(tp[0].recv_bytes < ep[0].recv_bytes);
}

#[test]
fn moe_bad_input_names_the_field() {
    use lifecycle_layout::ExpertPlacement::Partitioned;
    use lifecycle_plan::plan_fsdp_experts;
    let text = include_str!("../configs/qwen3-30b-a3b.json")
        .replace("\"num_experts\": 128", "\"num_experts\": 100")
        .replace("\"num_hidden_layers\": 48", "\"num_hidden_layers\": 1");
    let c = ModelConfig::from_json_str(&text).unwrap();
    // 100 experts over 8 ranks
    let e = plan_fsdp_experts(&c, 8, 8, 256 << 20, 2, Offload::NONE, Partitioned)
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_experts 100"), "{e}");
    // Megatron with experts: the plan of the expert layout; expert degrees that do not tile the
    // world are named
    let run = |train: &str, t: &str| {
        Command::new(env!("CARGO_BIN_EXE_lifecycle-plan"))
            .args([
                "--config",
                concat!(env!("CARGO_MANIFEST_DIR"), "/configs/qwen3-30b-a3b.json"),
            ])
            .args(["--train", train, "--rollout-tp", t, "--experts", "ep"])
            .output()
            .unwrap()
    };
    let out = run("megatron:tp=1,dp=8,ep=8,etp=1", "8");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // EP 8 trained, T 8 partitioned: every rank already holds its experts, and attention is
    // replicated over DP 8
    assert!(
        text.contains("recv d2d")
            && text.contains("ep=8,etp=1")
            && text.contains("receives nothing from its peers"),
        "{text}"
    );
    let out = run("megatron:tp=1,dp=8,ep=3", "8");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("ETP × EP × PP"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_lifecycle-plan"))
        .args([
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/configs/qwen3-30b-a3b.json"),
        ])
        .args(["--train", "fsdp:2", "--rollout-tp", "2", "--experts", "xp"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("tp or ep"), "{err}");
}

#[test]
fn fp8_plans_halve_the_quantised_bytes_and_refuse_split_blocks() {
    use lifecycle_layout::ExpertPlacement;
    use lifecycle_plan::plan_fsdp_fp8;
    let c = qwen7b();
    let t2 = plan_fsdp_fp8(
        &c,
        2,
        2,
        ExpertPlacement::TensorParallel,
        Default::default(),
    )
    .unwrap();
    let bf16 = plan_fsdp(&c, 2, 2, 256 << 20, 2, Offload::NONE).unwrap();
    // the bf16 side of the fp8 figures is the plan's own
    assert_eq!(t2[1].recv_bytes_bf16, bf16[1].recv_bytes);
    assert_eq!(t2[1].rollout_bytes_bf16, bf16[1].rollout_bytes);
    // what crosses the link is the row-parallel halves: fp8 bytes plus one scale per block
    assert!(t2[1].recv_bytes * 2 > t2[1].recv_bytes_bf16);
    assert!(t2[1].recv_bytes * 2 < t2[1].recv_bytes_bf16 + t2[1].recv_bytes_bf16 / 100);
    // 152064 vocabulary rows, kept bf16, split over T = 2 like the rest
    let embed = 152_064 * 3584 / 2 * 2;
    assert!(t2[1].rollout_bytes > (t2[1].rollout_bytes_bf16 - 2 * embed as u64) / 2);
    // a T whose slices cut 128-row blocks: T = 7 would also split heads, so use a model whose
    // intermediate size is not a multiple of 128 x 2
    let text = include_str!("../configs/qwen2.5-7b.json").replace("18944", "18960");
    let odd = ModelConfig::from_json_str(&text).unwrap();
    let e = plan_fsdp_fp8(
        &odd,
        2,
        2,
        ExpertPlacement::TensorParallel,
        Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("gate_proj") || e.contains("up_proj") || e.contains("down_proj"),
        "{e}"
    );
    assert!(e.contains("128"), "{e}");
}

fn plan_output(args: &[&str]) -> (bool, String, String) {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/qwen2.5-7b.json");
    let out = Command::new(env!("CARGO_BIN_EXE_lifecycle-plan"))
        .args(["--config", config])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn kv_dtype_defaults_and_pinned_memory_per_node_are_printed() {
    // A Megatron spec without dp says what it was taken as.
    let (ok, text, err) = plan_output(&["--train", "megatron:tp=2,pp=2", "--rollout-tp", "2"]);
    assert!(ok, "{text}{err}");
    assert!(
        text.contains("leaves out dp = 1: taken as megatron:tp=2,pp=2,dp=1 (4 ranks)"),
        "{text}"
    );
    let (ok, text, err) = plan_output(&["--train", "megatron:tp=2,pp=2,dp=1", "--rollout-tp", "2"]);
    assert!(ok, "{text}{err}");
    assert!(!text.contains("leaves out"), "{text}");

    // bf16 K/V by default: half the bytes per token of f32 (28 layers x 2 x 2 kv heads x 128).
    let per_token = |text: &str| -> String {
        let tail = text.split("tokens at ").nth(1).unwrap_or_default();
        tail.split(" per token")
            .next()
            .unwrap_or_default()
            .to_string()
    };
    let (_, bf16, _) = plan_output(&["--train", "fsdp:2", "--rollout-tp", "2"]);
    let (_, f32, _) = plan_output(&[
        "--train",
        "fsdp:2",
        "--rollout-tp",
        "2",
        "--kv-dtype",
        "f32",
    ]);
    assert_eq!(per_token(&bf16), "28.7 kB", "{bf16}");
    assert_eq!(per_token(&f32), "57.3 kB", "{f32}");
    assert!(bf16.contains("(bf16 K and V of its 28 layers"), "{bf16}");
    let (ok, _, err) = plan_output(&[
        "--train",
        "fsdp:2",
        "--rollout-tp",
        "2",
        "--kv-dtype",
        "f16",
    ]);
    assert!(!ok && err.contains("expected bf16, f32 or fp8"), "{err}");

    // Pinned memory: 16 ranks on two nodes of 8, each rank offloading the same.
    let (ok, text, err) = plan_output(&[
        "--train",
        "fsdp:16",
        "--rollout-tp",
        "4",
        "--offload",
        "all",
    ]);
    assert!(ok, "{text}{err}");
    let line = text
        .lines()
        .find(|l| l.starts_with("pinned host memory"))
        .unwrap_or_default();
    assert!(line.contains("8 GPUs per node, 2 node(s)"), "{line}");
    let (_, none, _) = plan_output(&[
        "--train",
        "fsdp:2",
        "--rollout-tp",
        "2",
        "--offload",
        "none",
    ]);
    assert!(none.contains("pinned host memory: none"), "{none}");

    // The default offloads by need, as the GPU runs do: the plan headlined is the one chosen.
    let (ok, roomy, err) = plan_output(&["--train", "fsdp:1", "--rollout-tp", "1"]);
    assert!(ok, "{roomy}{err}");
    assert!(
        roomy.contains("offload by need for 65536 KV tokens"),
        "{roomy}"
    );
    assert!(roomy.contains("nothing offloaded"), "{roomy}");
    assert!(roomy.contains("pinned host memory: none"), "{roomy}");
    let (ok, tight, err) = plan_output(&[
        "--train",
        "fsdp:1",
        "--rollout-tp",
        "1",
        "--kv-tokens",
        "1500000",
    ]);
    assert!(ok, "{tight}{err}");
    assert!(tight.contains("optimizer state offloaded"), "{tight}");
    assert!(!tight.contains("pinned host memory: none"), "{tight}");
}

#[test]
fn a_kept_fp8_layer_the_model_lacks_is_refused_before_anything_prints() {
    // Qwen2.5-7B has layers 0..28
    let fsdp = [
        "--train",
        "fsdp:2",
        "--rollout-tp",
        "2",
        "--rollout-dtype",
        "fp8",
    ];
    let (ok, text, err) = plan_output(&[&fsdp[..], &["--fp8-keep", "attention,layer:28"]].concat());
    assert!(!ok && text.is_empty(), "{text}");
    assert!(
        err.contains("fp8 keep layer:28: the model's decoder layers are numbered 0 to 27"),
        "{err}"
    );
    let (ok, text, err) = plan_output(&[&fsdp[..], &["--fp8-keep", "layer:27"]].concat());
    assert!(ok, "{text}{err}");
}
