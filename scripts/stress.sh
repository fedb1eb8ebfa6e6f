#!/usr/bin/env bash
# Run a command on a busy machine: CPU burners (plain busy loops at nice 0, as many as
# GPUPOOL_STRESS_BURNERS, default four per core: 8 on two cores, a load of 8 before the command
# adds its own) run for exactly as long as the command, which sees the machine a loaded CI host
# or laptop gives it. The suite must stay green this way:
#
#   bash scripts/stress.sh bash scripts/test.sh
#
# The command's exit status is this script's; at the end it prints the wall time and the load
# averages it saw (sampled every 5 s after the first minute, which the load average needs to
# rise), so a run can be compared with an idle one.
set -euo pipefail
if [ $# = 0 ]; then
  echo "usage: bash scripts/stress.sh COMMAND [ARG...]" >&2
  exit 2
fi
burners=${GPUPOOL_STRESS_BURNERS:-$((4 * $(nproc)))}
case $burners in
  '' | *[!0-9]*) echo "GPUPOOL_STRESS_BURNERS=$burners is not a whole number" >&2; exit 2 ;;
esac
pids=()
samples=$(mktemp)
command_pid=
stop_all() {
  trap - EXIT INT TERM
  [ -n "$command_pid" ] && kill -TERM "$command_pid" 2>/dev/null || true
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  rm -f "$samples"
}
trap stop_all EXIT
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
for _ in $(seq 1 "$burners"); do
  nice -n 0 sh -c 'while :; do :; done' &
  pids+=($!)
done
# The load average, every 5 s, for the summary (a sleeping loop, no load of its own).
( while :; do cut -d' ' -f1 /proc/loadavg >>"$samples"; sleep 5; done ) &
pids+=($!)
echo "stress: $burners CPU burners on $(nproc) cores, running: $*" >&2
started=$(date +%s)
"$@" &
command_pid=$!
set +e
wait "$command_pid"
status=$?
set -e
command_pid=
seconds=$(($(date +%s) - started))
summary=$(awk 'NR > 12 { n++; s += $1; if ($1 > m) m = $1 } END {
  if (n) printf "load average mean %.1f, max %.1f", s / n, m; else printf "run too short for a load sample (a minute)" }' "$samples")
echo "stress: exit $status after ${seconds} s under $burners burners; $summary" >&2
exit "$status"
