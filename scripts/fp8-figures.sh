#!/usr/bin/env bash
# The fp8 rollout figures on one GPU in one call: the decode rates of bf16, weight-only fp8 and
# W8A8 at the 7.6B and Qwen3-30B-A3B shapes (4 layers, batches 1 … 64), and the fp8 switches
# (FSDP resident enter at 7.6B and at Qwen3-30B-A3B with 8 layers, traced; Megatron at 7.6B with
# 16 layers and at Qwen3-30B-A3B with 8), each against its floor, all in one process lease so the
# ratios compare. Every part writes its log under OUT (default ./out); the summary at the end
# prints the ratios and how each part exited. The 8-layer MoE switch needs more than 80 GB (an
# H200: fp32 masters and Adam state beside the rollout).
#
#   scripts/fp8-figures.sh BIN [OUT]
#
# BIN holds the binaries (built on a CPU machine, stripped):
#   cargo build --release -p lifecycle-bench --bin decode_bench --bin fsdp_bench --bin megatron_bench
#   cp target/release/{decode_bench,fsdp_bench,megatron_bench} BIN/
# Run from the repository root.
set -uo pipefail

BIN=${1:?usage: scripts/fp8-figures.sh BIN [OUT]}
OUT=${2:-${OUT:-out}}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
declare -a SUMMARY=()

# shellcheck source=scripts/part.sh
source "$(dirname "${BASH_SOURCE[0]}")/part.sh"

{ date -u; nvidia-smi -L; } > "$OUT/machine.log" 2>&1
only="bf16;fp8 weight-only;W8A8 default"
part decode-dense 120 "$BIN/decode_bench" --layers 4 --batches 1,2,4,8,16,32,64 --new-tokens 32 --repeats 2 --only "$only"
part decode-moe 150 "$BIN/decode_bench" --moe --layers 4 --batches 1,2,4,8,16,32,64 --new-tokens 32 --repeats 2 --only "$only"
switch="--world 1 --tp 1 --fp8 --quick --skip-offload --skip-dapo --iters 5"
# shellcheck disable=SC2086
part switch-fsdp-dense 120 "$BIN/fsdp_bench" $switch
# shellcheck disable=SC2086
part switch-fsdp-moe 120 "$BIN/fsdp_bench" $switch --model qwen3-30b-a3b --layers 8 --trace "$OUT/trace"
part switch-megatron-dense 90 "$BIN/megatron_bench" --world 1 --fp8 --skip-offload --iters 5 --layers 16
part switch-megatron-moe 90 "$BIN/megatron_bench" --world 1 --fp8 --skip-offload --iters 5 --model qwen3-30b-a3b --layers 8

echo "== decode, W8A8 and weight-only fp8 against bf16 (tokens/s; prefill time)"
for s in dense moe; do
    echo "-- $s"
    grep -A8 'against bf16' "$OUT/decode-$s.log" | grep 'batch'
done
echo "== fp8 switches (resident enter against its floor)"
for s in fsdp-dense fsdp-moe megatron-dense megatron-moe; do
    echo "-- $s"
    grep -E '^(fp8|bf16) rollout weights, .*resident|fp8 resident: ' "$OUT/switch-$s.log" | head -4
done
echo "== parts"
printf '%s\n' "${SUMMARY[@]}"
