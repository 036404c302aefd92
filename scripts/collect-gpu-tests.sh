#!/usr/bin/env bash
# Builds the workspace's test binaries (release) and collects those holding GPU tests into one
# folder, for a GPU machine without cargo; scripts/gpu-suite.sh then runs them there.
#
#   scripts/collect-gpu-tests.sh DEST [CARGO-ARGS...]
#   scripts/collect-gpu-tests.sh .gpu-bin -j 1      # e.g.; CARGO_TARGET_DIR is honoured
#
# A test target holds GPU tests when a line of its source starts with the attribute
# `#[ignore = "needs an NVIDIA GPU"]` (comments do not count): the file of an integration test or binary target (tests/NAME.rs, src/bin/NAME.rs), or any file
# under the source folder of a library target (its unit tests). Each such executable is copied
# to DEST under a stable name, PACKAGE-TARGET (e.g. lifecycle-fsdp-gpu_reliability; library unit
# tests PACKAGE-lib, binaries PACKAGE-bin-NAME), with its debug info stripped. DEST also gets:
#   MANIFEST.tsv      name, package, target kind, target, source file, per collected binary;
#   COMMIT            the commit the binaries were built from (with "+dirty" for local changes);
#   gpu-suite.sh      the script that runs them (a copy of scripts/gpu-suite.sh);
#   decoder-fixtures/ the GPU decoder tests' oracle fixtures (models/decoder/fixtures).
# A DEST from an earlier run is refreshed: the binaries its MANIFEST.tsv lists are replaced. A
# DEST holding anything else is refused. Needs cargo and jq.
set -euo pipefail

MARKER='#[ignore = "needs an NVIDIA GPU"]'
MARKER_RE='^[[:space:]]*#\[ignore = "needs an NVIDIA GPU"\]'

die() {
    echo "collect-gpu-tests: $*" >&2
    exit 2
}

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    [ $# -lt 1 ] && exit 2
    exit 0
fi
DEST=$1
shift

command -v cargo >/dev/null || die "cargo is not on PATH"
command -v jq >/dev/null || die "jq is needed to read cargo's JSON messages (apt-get install jq)"

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
case "$DEST" in
    "$ROOT" | /) die "refusing to collect into $DEST" ;;
esac
if [ -f "$DEST/MANIFEST.tsv" ]; then
    # An earlier collection: remove exactly what it put there.
    while IFS=$'\t' read -r name _; do
        [ -n "$name" ] && [ "$name" != "name" ] && rm -f -- "$DEST/$name"
    done <"$DEST/MANIFEST.tsv"
    rm -rf -- "$DEST/decoder-fixtures"
    rm -f -- "$DEST/MANIFEST.tsv" "$DEST/COMMIT" "$DEST/gpu-suite.sh"
elif [ -n "$(ls -A "$DEST")" ]; then
    die "$DEST is not empty and holds no MANIFEST.tsv of an earlier collection: choose an empty folder"
fi

cd "$ROOT"
work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT

echo "collect-gpu-tests: building the test binaries (cargo test --workspace --release --no-run $*)" >&2
cargo metadata --no-deps --format-version 1 |
    jq -r '.packages[] | [.manifest_path, .name] | @tsv' >"$work/packages.tsv"
cargo test --workspace --release --no-run --message-format=json-render-diagnostics "$@" \
    >"$work/messages.json"

# One line per test executable: manifest path, target kind, target name, source, executable.
jq -r 'select(.reason == "compiler-artifact" and .profile.test and .executable != null)
       | [.manifest_path, (.target.kind | join(",")), .target.name, .target.src_path, .executable]
       | @tsv' "$work/messages.json" | sort -u >"$work/executables.tsv"

printf 'name\tpackage\tkind\ttarget\tsource\n' >"$work/MANIFEST.tsv"
count=0
while IFS=$'\t' read -r manifest kind target src exe; do
    package=$(awk -F'\t' -v m="$manifest" '$1 == m { print $2 }' "$work/packages.tsv")
    [ -n "$package" ] || die "no package for $manifest"
    case "$kind" in
        test)
            grep -qE -- "$MARKER_RE" "$src" || continue
            name="$package-$target"
            ;;
        bin)
            grep -qE -- "$MARKER_RE" "$src" || continue
            name="$package-bin-$target"
            ;;
        *)
            grep -rqE --include='*.rs' -- "$MARKER_RE" "$(dirname "$src")" || continue
            name="$package-lib"
            ;;
    esac
    [ -e "$DEST/$name" ] && die "two test targets collect to the name $name"
    cp -- "$exe" "$DEST/$name"
    if command -v strip >/dev/null; then
        strip --strip-debug "$DEST/$name"
    fi
    chmod +x "$DEST/$name"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$package" "$kind" "$target" "${src#"$ROOT"/}" \
        >>"$work/MANIFEST.tsv"
    echo "  $name  <- ${src#"$ROOT"/}" >&2
    count=$((count + 1))
done <"$work/executables.tsv"

[ "$count" -gt 0 ] || die "no test target holds $MARKER"
cp -- "$work/MANIFEST.tsv" "$DEST/MANIFEST.tsv"
cp -- "$ROOT/scripts/gpu-suite.sh" "$DEST/gpu-suite.sh"
if [ -d models/decoder/fixtures ]; then
    cp -R models/decoder/fixtures "$DEST/decoder-fixtures"
fi
commit=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]; then
    commit="$commit+dirty"
fi
echo "$commit" >"$DEST/COMMIT"
echo "collect-gpu-tests: $count binaries in $DEST (commit $commit); run them with" >&2
echo "  $DEST/gpu-suite.sh $DEST      (or scripts/gpu-suite.sh $DEST)" >&2
