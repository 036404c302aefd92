#!/usr/bin/env bash
# Runs the whole GPU test suite from a folder of prebuilt test binaries (made by
# scripts/collect-gpu-tests.sh; no cargo needed) and prints a summary.
#
#   scripts/gpu-suite.sh DIR [TEST-ARGS...]
#   scripts/gpu-suite.sh .gpu-bin                     # every GPU test
#   scripts/gpu-suite.sh .gpu-bin --nocapture         # with the tests' own output
#   scripts/gpu-suite.sh .gpu-bin shared_gpu          # only tests whose name holds shared_gpu
#
# Each binary listed in DIR/MANIFEST.tsv (every executable file of DIR when there is none) runs
# as `BINARY --ignored --test-threads=1 TEST-ARGS...`, its output shown and kept in a log. A
# test that needs more GPUs than the machine shows fails saying "needs N GPUs, found M"; none
# passes untested. The summary gives passed / failed per binary, each failed test with the first
# line of its message, and the exit status is 0 only when every binary ran, every test passed and
# at least one test ran.
#
# Environment: NCCL_NVLS_ENABLE defaults to 0 (NVLink multicast off); LIFECYCLE_DECODER_FIXTURES
# defaults to DIR/decoder-fixtures when that exists; GPU_SUITE_LOGS names the log folder (default
# a new temporary folder); GPU_SUITE_TIMEOUT, in seconds, bounds each binary (needs `timeout`).
set -uo pipefail

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
    [ $# -lt 1 ] && exit 2
    exit 0
fi
DIR=$1
shift
[ -d "$DIR" ] || {
    echo "gpu-suite: $DIR is not a folder" >&2
    exit 2
}
DIR=$(cd "$DIR" && pwd)

export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
if [ -z "${LIFECYCLE_DECODER_FIXTURES:-}" ] && [ -d "$DIR/decoder-fixtures" ]; then
    export LIFECYCLE_DECODER_FIXTURES="$DIR/decoder-fixtures"
fi
LOGS="${GPU_SUITE_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite.XXXXXX")}"
mkdir -p "$LOGS" || exit 2

# The binaries, in a stable order.
bins=()
if [ -f "$DIR/MANIFEST.tsv" ]; then
    while IFS=$'\t' read -r name _; do
        [ -n "$name" ] && [ "$name" != "name" ] && bins+=("$name")
    done <"$DIR/MANIFEST.tsv"
else
    for f in "$DIR"/*; do
        [ -f "$f" ] && [ -x "$f" ] && [ "${f##*.}" != "sh" ] && bins+=("$(basename "$f")")
    done
fi
[ ${#bins[@]} -gt 0 ] || {
    echo "gpu-suite: no test binaries in $DIR (make them with scripts/collect-gpu-tests.sh)" >&2
    exit 2
}

limit=()
if [ -n "${GPU_SUITE_TIMEOUT:-}" ]; then
    if command -v timeout >/dev/null; then
        limit=(timeout --kill-after=30 "$GPU_SUITE_TIMEOUT")
    else
        echo "gpu-suite: GPU_SUITE_TIMEOUT is set but \`timeout\` is missing: running unbounded" >&2
    fi
fi

# Prints "NAME<TAB>FIRST LINE OF ITS MESSAGE" for every failed test of a libtest log.
failures() {
    awk '
        /^test .* \.\.\. FAILED$/ { name = $2; failed[++n] = name }
        /^---- .* stdout ----$/ { cur = $2; want = 1; next }
        want && cur != "" {
            if ($0 ~ /^thread .* panicked at /) next
            if ($0 ~ /^[[:space:]]*$/) next
            m = $0
            if (length(m) > 200) m = substr(m, 1, 197) "..."
            msg[cur] = m; want = 0
        }
        END { for (i = 1; i <= n; i++) printf "%s\t%s\n", failed[i], msg[failed[i]] }
    ' "$1"
}

summary=()
total_pass=0
total_fail=0
bad=0
started=$(date +%s)
commit=""
[ -f "$DIR/COMMIT" ] && commit=" (built from $(cat "$DIR/COMMIT"))"
echo "gpu-suite: ${#bins[@]} binaries from $DIR$commit; logs in $LOGS"
nvidia-smi -L 2>/dev/null | sed 's/^/gpu-suite: /' || echo "gpu-suite: nvidia-smi not found"

for name in "${bins[@]}"; do
    bin="$DIR/$name"
    log="$LOGS/$name.log"
    echo
    echo "=== $name --ignored --test-threads=1 $*"
    if [ ! -x "$bin" ]; then
        echo "gpu-suite: $bin is missing or not executable" | tee "$log"
        summary+=("$(printf '%-40s %s' "$name" "MISSING")")
        bad=1
        continue
    fi
    t0=$(date +%s)
    ${limit[@]+"${limit[@]}"} "$bin" --ignored --test-threads=1 "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    secs=$(($(date +%s) - t0))
    result=$(grep -E '^test result: ' "$log" | tail -n 1)
    passed=$(sed -n 's/.* \([0-9][0-9]*\) passed;.*/\1/p' <<<"$result")
    failed=$(sed -n 's/.* \([0-9][0-9]*\) failed;.*/\1/p' <<<"$result")
    if [ -z "$result" ] || [ -z "$passed" ] || [ -z "$failed" ]; then
        # No result line: the binary crashed, was killed or is not a test binary.
        summary+=("$(printf '%-40s %s' "$name" "NO RESULT (exit $status, ${secs} s): see $log")")
        bad=1
        continue
    fi
    total_pass=$((total_pass + passed))
    total_fail=$((total_fail + failed))
    line=$(printf '%-40s %3d passed %3d failed   exit %3d  %5d s' "$name" "$passed" "$failed" "$status" "$secs")
    if [ "$failed" -gt 0 ] || [ "$status" -ne 0 ]; then
        bad=1
        line="$line   FAILED"
    fi
    summary+=("$line")
    while IFS=$'\t' read -r test msg; do
        [ -n "$test" ] && summary+=("    FAILED $test: ${msg:-see $log}")
    done < <(failures "$log")
done

echo
echo "==================== GPU suite summary ===================="
printf '%s\n' "${summary[@]}"
echo "total: $total_pass passed, $total_fail failed, $((($(date +%s) - started))) s; logs in $LOGS"
if [ $((total_pass + total_fail)) -eq 0 ]; then
    echo "gpu-suite: no test ran (a name filter that matches nothing?)"
    bad=1
fi
if [ "$bad" -ne 0 ]; then
    echo "GPU suite: FAILED"
    exit 1
fi
echo "GPU suite: ok"
