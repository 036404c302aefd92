# Sourced by the job scripts (two-gpu-job.sh, fp8-figures.sh): `part NAME LIMIT CMD...` runs CMD
# for at most LIMIT seconds with its output in "$OUT/NAME.log" (after the date and the command),
# adds "NAME: exit RC" to the SUMMARY array and prints the log's last 4 lines. The caller sets OUT
# and declares SUMMARY.
part() {
    local name=$1 limit=$2
    shift 2
    { date -u; echo "+ $*"; } > "$OUT/$name.log"
    timeout "$limit" "$@" >> "$OUT/$name.log" 2>&1
    local rc=$?
    SUMMARY+=("$name: exit $rc")
    tail -n 4 "$OUT/$name.log"
}
