//! The fp8 switch on the CPU (partial amaxes on the source ranks, agreed by max, each piece
//! quantised by its source) against the independent reference (every full tensor quantised
//! whole, then sliced): bit for bit over W ≤ 4, T ∈ {1, 2, 4} dividing W, with blocks that span
//! FSDP shard boundaries (W = 3), partial edge blocks, TP slices of whole blocks, experts owned
//! by one rank and tensors kept bf16.

use lifecycle_host::fp8::{fp8_reference, fp8_switch, fp8_switch_with};
use lifecycle_host::HostTrainState;
use lifecycle_layout::fp8::{e4m3_to_f32, Fp8Keep};
use lifecycle_layout::{HostTensor, Parallel, RolloutLayout, TensorSpec};

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("model.embed_tokens.weight", [40, 256], Parallel::Column),
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            [512, 256],
            Parallel::Column,
        ),
        TensorSpec::new(
            "model.layers.0.self_attn.o_proj.weight",
            [260, 512],
            Parallel::Row,
        ),
        TensorSpec::new(
            "model.layers.0.input_layernorm.weight",
            [256],
            Parallel::Replicated,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.gate.weight",
            [4, 256],
            Parallel::Replicated,
        ),
        TensorSpec::new(
            "model.layers.0.mlp.experts.0.up_proj.weight",
            [300, 129],
            Parallel::Owned { rank: 0 },
        ),
        TensorSpec::new(
            "model.layers.0.mlp.experts.1.up_proj.weight",
            [300, 129],
            Parallel::Owned { rank: 0 },
        ),
    ]
}

fn state(world: usize, specs: &[TensorSpec]) -> HostTrainState {
    let tensors = specs
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let data = (0..s.numel())
                .map(|i| {
                    // magnitudes spread over blocks, signed, some exact zeros
                    let x = ((i * 2_654_435_761 + k * 97) % 10_007) as f32 / 10_007.0 - 0.5;
                    let scale = 1.0 + ((i / 128) % 7) as f32 * 3.0;
                    if i % 53 == 0 {
                        0.0
                    } else {
                        x * scale * 0.01
                    }
                })
                .collect();
            HostTensor::f32(s.name.clone(), s.shape.clone(), data)
        })
        .collect();
    HostTrainState::from_tensors(world, tensors).unwrap()
}

#[test]
fn the_fp8_switch_equals_the_full_tensor_reference() {
    let mut checked = 0;
    for world in [1, 2, 3, 4] {
        for tp in [1, 2, 4].into_iter().filter(|t| world % t == 0) {
            let mut specs = specs();
            // the experts partitioned: one per rank where there are two ranks or more
            specs[6].parallel = Parallel::Owned {
                rank: tp.min(2) - 1,
            };
            let st = state(world, &specs);
            let layout = RolloutLayout::new(tp, specs).unwrap();
            let got = fp8_switch(&st, &layout).unwrap();
            let want = fp8_reference(&st, &layout, Fp8Keep::default()).unwrap();
            assert_eq!(got, want, "W={world} T={tp}");
            // and the values are the masters within e4m3's half-ulp of their block's scale
            for (r, rank) in got.ranks.iter().enumerate() {
                for t in &rank.tensors {
                    if let Some(q) = &t.fp8 {
                        let (data, scale_inv) = (q.data(), q.scale_inv());
                        assert!(!scale_inv.is_empty() && data.iter().all(|b| b & 0x7f != 0x7f));
                        let worst = data
                            .iter()
                            .map(|b| e4m3_to_f32(*b).abs())
                            .fold(0.0f32, f32::max);
                        assert!(worst <= 448.0, "W={world} T={tp} rank {r}");
                    }
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 7);
}

#[test]
fn non_finite_masters_and_split_blocks_are_refused_by_name() {
    let specs = specs();
    let mut tensors: Vec<HostTensor> = specs
        .iter()
        .map(|s| HostTensor::f32(s.name.clone(), s.shape.clone(), vec![0.25; s.numel()]))
        .collect();
    if let lifecycle_layout::TensorData::F32(v) = &mut tensors[1].data {
        v[1000] = f32::INFINITY;
    }
    let st = HostTrainState::from_tensors(2, tensors).unwrap();
    let err = fp8_switch(&st, &RolloutLayout::new(2, specs.clone()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("q_proj"), "{err}");
    // T = 4 over the 260 x 512 row-parallel tensor: 128 columns per rank, whole blocks; over a
    // 384-row column-parallel one at T = 4: 96 rows per rank cut the first block
    let cut = vec![TensorSpec::new(
        "model.layers.0.mlp.up_proj.weight",
        [384, 128],
        Parallel::Column,
    )];
    let st = state(4, &cut);
    let err = fp8_switch(&st, &RolloutLayout::new(4, cut).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("up_proj") && err.contains("128"), "{err}");
}

#[test]
fn the_fp8_keep_setting_keeps_attention_or_layers_bf16_and_the_reference_agrees() {
    let specs = specs();
    let st = state(3, &specs);
    let layout = RolloutLayout::new(1, specs.clone()).unwrap();
    for (setting, bf16) in [
        ("none", vec![0, 3, 4]),
        ("attention", vec![0, 1, 2, 3, 4]),
        ("layer:0", vec![0, 1, 2, 3, 4, 5, 6]),
    ] {
        let keep: Fp8Keep = setting.parse().unwrap();
        let got = fp8_switch_with(&st, &layout, keep).unwrap();
        assert_eq!(got, fp8_reference(&st, &layout, keep).unwrap(), "{setting}");
        let kept: Vec<usize> = got.ranks[0]
            .tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| t.fp8.is_none())
            .map(|(i, _)| i)
            .collect();
        assert_eq!(kept, bf16, "{setting}: the tensors kept bf16");
    }
    let err = "layers:0".parse::<Fp8Keep>().unwrap_err();
    assert!(err.contains("layers:0") && err.contains("layer:N"), "{err}");
}

/// The fp8 plan's steps (bf16 casts and quantisations in one step program) run on the host step
/// runner, under several stream interleavings, equal the fp8 switch bit for bit at W = 1; a
/// quantisation reading a bf16 training buffer, or leaving the rollout buffer, is refused.
#[test]
fn fp8_quantisation_runs_as_a_step_and_matches_the_fp8_switch() {
    use half::bf16;
    use lifecycle_host::steps::{run_steps, Source};
    use lifecycle_layout::fsdp::{build_fp8_plan, BucketConfig};
    use lifecycle_layout::plan_fsdp_to_tp;
    use lifecycle_layout::steps::SourceType;
    use lifecycle_layout::HostRollout;

    for keep in [Fp8Keep::default(), "attention".parse().unwrap()] {
        let specs = specs();
        let st = state(1, &specs);
        let layout = RolloutLayout::new(1, specs).unwrap();
        let core = plan_fsdp_to_tp(st.layout(), &layout).unwrap();
        let plan = build_fp8_plan(core, st.layout(), BucketConfig::default(), keep).unwrap();
        let steps = plan.rank_steps(0).unwrap();
        assert!(
            !steps.quantise.is_empty(),
            "the plan quantises on the device"
        );
        let shards = &plan.shards;
        let mut flat = vec![0.0f32; shards.rank_len as usize];
        for (i, slot) in shards.slots.iter().enumerate() {
            let shard = st.master_shard(0, i).unwrap();
            flat[slot.offset as usize..slot.offset as usize + shard.len()].copy_from_slice(shard);
        }
        let out = run_steps(vec![steps.clone()], &[Source::F32(&flat)], &[1, 2, 3]).unwrap();
        let out_f32 = out.clone();
        let rolls: Vec<Vec<bf16>> = out
            .into_iter()
            .map(|r| r.into_iter().map(bf16::from_bits).collect())
            .collect();
        let got = HostRollout::from_flat(&plan.entries(0), rolls).unwrap();
        let want = fp8_switch_with(&st, &layout, keep).unwrap();
        assert_eq!(got, want, "keep {keep}");

        // The same steps over bf16 parameters (the masters rounded to bf16, as the Megatron
        // switch quantises them): every slot as the fp32 run over the rounded values writes it.
        let rounded: Vec<f32> = flat.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        let bits: Vec<u16> = rounded
            .iter()
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect();
        let mut bf16_source = steps.clone();
        bf16_source.source = SourceType::Bf16;
        let over_bf16 = run_steps(vec![bf16_source], &[Source::Bf16(&bits)], &[1, 2]).unwrap();
        let over_f32 = run_steps(vec![steps.clone()], &[Source::F32(&rounded)], &[1, 2]).unwrap();
        assert_eq!(over_bf16, over_f32, "keep {keep}");
        assert_ne!(
            over_f32, out_f32,
            "keep {keep}: the rounding changed nothing"
        );
        let mut outside = steps.clone();
        outside.quantise[0].dst_byte = 2 * outside.rollout_elems;
        let e = outside.validate().unwrap_err().to_string();
        assert!(
            e.contains("quantisation 0") && e.contains("leaves its buffers"),
            "{e}"
        );
    }
}

/// The rollouts of `plan`'s steps on the host step runner (under several stream interleavings),
/// every rank's buffer read back through its entries; `peer` runs cross-rank bytes as peer
/// copies.
fn run_fp8_plan(
    plan: &lifecycle_layout::fsdp::FsdpPlan,
    st: &HostTrainState,
    peer: bool,
) -> Result<lifecycle_layout::HostRollout, lifecycle_host::HostError> {
    use half::bf16;
    use lifecycle_host::steps::{run_steps, Source};
    use lifecycle_layout::{HostRollout, RankRollout};

    let world = plan.core.world;
    let mut plan = plan.clone();
    plan.peer_copy = peer;
    let shards = &plan.shards;
    let masters: Vec<Vec<f32>> = (0..world)
        .map(|r| {
            let mut flat = vec![0.0f32; shards.rank_len as usize];
            for (i, slot) in shards.slots.iter().enumerate() {
                let shard = st.master_shard(r, i).unwrap();
                flat[slot.offset as usize..slot.offset as usize + shard.len()]
                    .copy_from_slice(shard);
            }
            flat
        })
        .collect();
    let steps = (0..world)
        .map(|r| plan.rank_steps(r))
        .collect::<Result<Vec<_>, _>>()?;
    let sources: Vec<Source<'_>> = masters.iter().map(|m| Source::F32(m)).collect();
    let out = run_steps(steps, &sources, &[1, 2, 3, 4])?;
    let mut ranks: Vec<RankRollout> = Vec::with_capacity(world);
    for (r, roll) in out.into_iter().enumerate() {
        let roll: Vec<bf16> = roll.into_iter().map(bf16::from_bits).collect();
        let one = HostRollout::from_flat(&plan.entries(r), vec![roll])
            .unwrap_or_else(|| panic!("rank {r}: the entries do not read the buffer"));
        ranks.extend(one.ranks);
    }
    Ok(HostRollout { ranks })
}

/// [`specs`] with the experts two columns wider: an even width, so every FSDP shard split of
/// them moves whole 2-byte elements, still with a partial edge block.
fn even_specs() -> Vec<TensorSpec> {
    specs()
        .into_iter()
        .map(|s| {
            if s.name.contains("experts") {
                TensorSpec::new(s.name, [300, 130], s.parallel)
            } else {
                s
            }
        })
        .collect()
}

/// fp8 at W ∈ {2, 3, 4}, T ∈ {1, 2, 4} dividing W: the plan's steps (partial amaxes, the
/// agreement by all-reduce, the pieces quantised with the agreed scales and sent as e4m3 bytes)
/// run on the host step runner under several interleavings, with every gather mode, small and
/// large buckets, and as peer copies, equal the host executor's fp8 switch and the
/// full-tensor reference bit for bit. Blocks span shard boundaries (W = 3: 512 rows as 171 /
/// 171 / 170), T = 2 slices row-parallel `o_proj` by columns (pieces staged), experts live on
/// one rank.
#[test]
fn fp8_plans_at_w_above_1_match_the_host_executor_on_the_step_runner() {
    use lifecycle_layout::fsdp::{build_fp8_plan, BucketConfig, GatherMode};
    use lifecycle_layout::plan_fsdp_to_tp;

    let keeps: [Fp8Keep; 2] = [Fp8Keep::default(), "attention".parse().unwrap()];
    for world in [2, 3, 4] {
        for tp in [1, 2, 4].into_iter().filter(|t| world % t == 0) {
            let specs = even_specs();
            let st = state(world, &specs);
            let layout = RolloutLayout::new(tp, specs).unwrap();
            for keep in keeps {
                let want = fp8_switch_with(&st, &layout, keep).unwrap();
                assert_eq!(want, fp8_reference(&st, &layout, keep).unwrap());
                for (bucket_bytes, mode) in [
                    (256 << 20, GatherMode::SendRecv),
                    (4096, GatherMode::SendRecv),
                    (4096, GatherMode::AllGather),
                    (4096, GatherMode::Packed),
                ] {
                    let core = plan_fsdp_to_tp(st.layout(), &layout).unwrap();
                    let config = BucketConfig {
                        bucket_bytes,
                        in_flight: 2,
                        mode,
                    };
                    let plan = build_fp8_plan(core, st.layout(), config, keep).unwrap();
                    let steps = plan.rank_steps(0).unwrap();
                    let agree = steps.agree.as_ref().expect("an agreed fp8 switch");
                    assert!(steps.quantise.is_empty() && !agree.amax.is_empty());
                    for peer in [false, true]
                        .into_iter()
                        .filter(|p| !p || plan.peer_copyable())
                    {
                        let got = run_fp8_plan(&plan, &st, peer).unwrap();
                        assert_eq!(
                            got, want,
                            "W={world} T={tp} keep {keep} {mode:?} {bucket_bytes} peer {peer}"
                        );
                    }
                }
            }
        }
    }
}

/// Only fp8 bytes cross the links: at W = 2, T = 1 each rank receives the other's half of every
/// quantised tensor as e4m3 bytes (1 byte per value), stages nothing (it sends from its own
/// rollout buffer) and allocates one f32 per block of the scale grid.
#[test]
fn fp8_at_w2_sends_e4m3_bytes_from_the_rollout_buffer() {
    use lifecycle_layout::fsdp::{build_fp8_plan, BucketConfig};
    use lifecycle_layout::plan_fsdp_to_tp;

    let specs = vec![TensorSpec::new(
        "model.layers.0.mlp.up_proj.weight",
        [512, 256],
        Parallel::Column,
    )];
    let st = state(2, &specs);
    let layout = RolloutLayout::new(1, specs).unwrap();
    let core = plan_fsdp_to_tp(st.layout(), &layout).unwrap();
    let plan = build_fp8_plan(
        core,
        st.layout(),
        BucketConfig::default(),
        Fp8Keep::default(),
    )
    .unwrap();
    for r in 0..2 {
        let steps = plan.rank_steps(r).unwrap();
        let agree = steps.agree.as_ref().unwrap();
        assert_eq!(agree.grid_elems, 4 * 2);
        assert_eq!(agree.stage_elems, 0);
        assert_eq!(
            steps.recv_elems,
            256 * 256 / 2,
            "rank {r}: 256 rows of e4m3"
        );
        let net = &steps.steps[agree.step.unwrap()];
        assert_eq!(net.sends.len(), 1);
        assert_eq!(net.sends[0].buf, lifecycle_layout::steps::Buf::Rollout);
    }
    assert_eq!(
        run_fp8_plan(&plan, &st, false).unwrap(),
        fp8_switch(&st, &layout).unwrap()
    );
}

/// A shard split that would move an odd number of e4m3 bytes (129-column experts in 75-row
/// shards at W = 4) is refused before anything runs, naming the tensor and the way out.
#[test]
fn an_odd_byte_split_at_w_above_1_is_refused_by_name() {
    use lifecycle_layout::fsdp::{build_fp8_plan, BucketConfig};
    use lifecycle_layout::plan_fsdp_to_tp;

    let specs = specs();
    let st = state(4, &specs);
    let layout = RolloutLayout::new(1, specs.clone()).unwrap();
    let core = plan_fsdp_to_tp(st.layout(), &layout).unwrap();
    // refused when the plan is built, before any executor sees it
    let err = build_fp8_plan(
        core,
        st.layout(),
        BucketConfig::default(),
        Fp8Keep::default(),
    )
    .expect_err("an odd split")
    .to_string();
    assert!(
        err.contains("experts.0.up_proj") && err.contains("Fp8Keep"),
        "{err}"
    );
    // at W = 2 the same experts split into 150-row shards: an even byte count
    let st = state(2, &specs);
    let layout = RolloutLayout::new(1, specs).unwrap();
    let core = plan_fsdp_to_tp(st.layout(), &layout).unwrap();
    let plan = build_fp8_plan(
        core,
        st.layout(),
        BucketConfig::default(),
        Fp8Keep::default(),
    )
    .unwrap();
    assert_eq!(
        run_fp8_plan(&plan, &st, false).unwrap(),
        fp8_switch(&st, &layout).unwrap()
    );
}
