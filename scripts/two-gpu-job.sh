#!/usr/bin/env bash
# The two-GPU job in one call: the GPU suite at W = 2, the headline benchmarks with the PyTorch
# peer right after them, one process per GPU (lifecycle-launch and torchrun), and the GPU DAPO
# loop lazy vs eager on the 7.6B shape (also with a KV room that forces an overlapped offload),
# then the Python bridge. Every part writes its log under OUT (default ./out) and
# the job goes on when a part fails; the summary at the end says which part exited how.
#
#   scripts/two-gpu-job.sh BIN [OUT]
#
# BIN holds the binaries (built on a CPU machine, stripped):
#   scripts/collect-gpu-tests.sh BIN
#   cargo build --release -p lifecycle-bench -p lifecycle-dist --bins && cargo build --release --example dapo
#   cp target/release/{fsdp_bench,megatron_bench,fsdp_procs,lifecycle-launch} target/release/examples/dapo BIN/
#   cp ../shared/bench/torch_reshard_baseline.py bench/torch_moe_cast_peer.py BIN/
#   maturin build -m python/Cargo.toml --release -o BIN     (the Python bridge's wheel)
#   pip download megatron-core==0.19.2 --no-deps -d BIN      (the Megatron-Core parts)
# Run from the repository root (the decoder fixtures and MoE checkpoints are read from there).
# GPUS (default 2) sets W; with GPUS=1 the job is a dry run on one GPU: every command runs at
# W = 1 where it can, and the tests that need two GPUs fail saying so.
set -uo pipefail

BIN=${1:?usage: scripts/two-gpu-job.sh BIN [OUT]}
OUT=${2:-${OUT:-out}}
W=${GPUS:-2}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
declare -a SUMMARY=()

# shellcheck source=scripts/part.sh
source "$(dirname "${BASH_SOURCE[0]}")/part.sh"

{ date -u; nvidia-smi -L; } > "$OUT/machine.log" 2>&1

# 1. the whole GPU suite
part suite 900 env GPU_SUITE_LOGS="$OUT/suite-logs" GPU_SUITE_TIMEOUT=400 "$BIN/gpu-suite.sh" "$BIN" --nocapture

# 2. benchmarks, then the PyTorch peer right after
part fsdp_bench 600 "$BIN/fsdp_bench" --world "$W" --skip-dapo
# fp8 rollout weights at W: the block scales agreed across the ranks (NCCL all-reduce by max)
part fsdp_bench_fp8 600 "$BIN/fsdp_bench" --world "$W" --skip-dapo --skip-offload --quick --tp 1 --fp8
part megatron_bench 600 "$BIN/megatron_bench" --world "$W"
part moe_bench 300 "$BIN/fsdp_bench" --world "$W" --model qwen3-30b-a3b --layers 8 --skip-dapo --fp8 --experts ep
part megatron_moe_bench 300 "$BIN/megatron_bench" --world "$W" --model qwen3-30b-a3b --layers 8 --ep "$W" --experts ep
for tp in 1 "$W"; do
    part "torch_peer_t$tp" 600 torchrun --nproc_per_node="$W" "$BIN/torch_reshard_baseline.py" --model 7b --tp "$tp"
done
part torch_moe_peer 120 python3 "$BIN/torch_moe_cast_peer.py" --layers 8

# 3. one process per GPU
part launch_fsdp 300 "$BIN/lifecycle-launch" --nproc-per-node "$W" -- "$BIN/fsdp_procs" --layers 4
part torchrun_fsdp 300 torchrun --nproc_per_node="$W" --no-python "$BIN/fsdp_procs" --layers 4
part launch_dapo 300 "$BIN/lifecycle-launch" --nproc-per-node "$W" -- "$BIN/dapo" --backend fsdp --gpus "$W" --tp "$W"

# 4. DAPO lazy vs eager, 7.6B shape, engine kept alive
part dapo_fsdp_7b 600 "$BIN/dapo" --backend fsdp --gpus "$W" --tp "$W" --synthetic 7b --steps 2
# a KV room that forces an offload (850 000 tokens of f32 K/V force master + Adam out at W = 1; the
# engine's default bf16 cache would need twice the tokens), the offload overlapped with the rollout
# and then settled before it: the rollout's wait and decode speed
KV=${KV_TOKENS:-$((850000 * W))}
part dapo_fsdp_7b_kv_overlap 600 "$BIN/dapo" --backend fsdp --gpus "$W" --tp "$W" --synthetic 7b --steps 2 --samples-digest --kv-tokens "$KV" --kv-dtype f32
part dapo_fsdp_7b_kv_settled 600 "$BIN/dapo" --backend fsdp --gpus "$W" --tp "$W" --synthetic 7b --steps 2 --samples-digest --kv-tokens "$KV" --kv-dtype f32 --offload-overlap false
part dapo_megatron_7b_kv_overlap 600 "$BIN/dapo" --backend megatron --gpus "$W" --tp "$W" --synthetic 7b --steps 2 --samples-digest --kv-tokens "$KV" --kv-dtype f32
part dapo_fsdp_7b_fp8 600 "$BIN/dapo" --backend fsdp --gpus "$W" --tp "$W" --synthetic 7b --steps 2 --samples-digest --rollout-dtype fp8 --fp8-compute w8a8
part dapo_megatron_7b 600 "$BIN/dapo" --backend megatron --gpus "$W" --tp "$W" --synthetic 7b --steps 2
part dapo_megatron_moe 300 "$BIN/dapo" --backend megatron --gpus "$W" --tp "$W" --train-tp 1 --pp 1 --ep "$W" --etp 1 --experts ep --checkpoint models/decoder/fixtures/moe/moe_e4_untied_v61 --steps 3

# 5. The Python bridge: its wheel from BIN, the GPU tests (W = 1 per process), FSDP2 on CPU
# tensors at W = 2..4 (gloo), the 7.6B refresh beside the Rust backend, DAPO under torchrun at W
# (one process per GPU, rollouts at T = W)
if ls "$BIN"/lifecycle-*.whl > /dev/null 2>&1; then
    part bridge_install 120 python -m pip install --force-reinstall --no-deps --no-index "$BIN"/lifecycle-*.whl
    part bridge_gpu_tests 300 python -m pytest -q python/tests/gpu python/tests/test_host.py
    for g in 2 3 4; do
        part "bridge_gloo_w$g" 120 torchrun --nproc_per_node="$g" --master_port=2962"$g" python/tests/gpu/fsdp2_gloo.py
    done
    part bridge_enter_7b 300 python python/bench/fsdp2_enter.py --model 7b --iters 5
    part bridge_dapo 600 torchrun --nproc_per_node="$W" python/examples/dapo.py --steps 12
    # Megatron-Core (its wheel in BIN too) at TP = W and PP = W, a GPU per rank over NCCL, and
    # the ranks sharing GPU 0 over gloo; the >= 1 B refresh beside the Rust backend
    if ls "$BIN"/megatron_core-*.whl > /dev/null 2>&1; then
        part megatron_install 120 python -m pip install --no-deps --no-index "$BIN"/megatron_core-*.whl
        for how in "--tp $W" "--pp $W"; do
            for backend in nccl gloo; do
                # shellcheck disable=SC2086
                part "megatron_ranks_${backend}_${how// /}" 120 torchrun --nproc_per_node="$W" \
                    --master_port=29631 python/tests/gpu/megatron_ranks.py $how --backend "$backend"
            done
        done
        # experts over EP = W ranks (dense DP = W), the ranks sharing GPU 0
        part megatron_ranks_gloo_ep 120 torchrun --nproc_per_node="$W" --master_port=29631 \
            python/tests/gpu/megatron_ranks.py --dp "$W" --moe --ep "$W" --backend gloo
        part megatron_enter 300 python python/bench/megatron_enter.py --config-out "$OUT/qwen3_2b.json"
        part megatron_enter_rust 300 "$BIN/megatron_bench" --world 1 --skip-offload --iters 5 \
            --config "$OUT/qwen3_2b.json"
    fi
else
    SUMMARY+=("bridge: skipped (no lifecycle-*.whl in $BIN)")
fi

printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.log"
