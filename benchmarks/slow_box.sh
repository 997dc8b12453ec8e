#!/usr/bin/env bash
# Benchmark helper (not a test): run a command on an emulated slower CPU box — this machine capped at CPUS cores'
# worth of time by a cgroup CPU quota (root; cgroup v1 or v2) — to measure `make demo` on "the slow box" of issue 25
# without having one. Why a quota: CI's 2-core boxes differ by up to 4x (docs/cpu.md#cpu-boxes-differ); on a
# 2-core AMX box a cap of 0.75 CPU made stage 00's box speed read 178-268 tok/s (the slow box: 205) and reproduced the
# slow box's stage 02 (400 s here vs 408 s there; its self-distillation 22.9 vs 27 tok/s). A quota is coarse: it
# slows every process of the command together, so one serial process runs relatively faster than on a truly slow
# core and parallel ones relatively slower; compare stage 00's box speed before quoting a time.
#   sudo bash benchmarks/slow_box.sh 0.75 .venv/bin/eagle3 run --config configs/demo.yaml -p run.output_root=/tmp/slow
set -euo pipefail
cpus=$1; shift
quota=$(python3 -c "print(int(float('$cpus') * 100000))")
name=eagle3-slow-box-$$
if [ -d /sys/fs/cgroup/cpu ]; then  # cgroup v1
  dir=/sys/fs/cgroup/cpu/$name; mkdir -p "$dir"
  echo 100000 > "$dir/cpu.cfs_period_us"; echo "$quota" > "$dir/cpu.cfs_quota_us"
else  # cgroup v2
  dir=/sys/fs/cgroup/$name; mkdir -p "$dir"
  echo "$quota 100000" > "$dir/cpu.max"
fi
trap 'rmdir "$dir" 2>/dev/null || true' EXIT
start=$(date +%s)
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$dir" "$@" && rc=0 || rc=$?
echo "[slow_box] $cpus CPU: exit $rc after $(( $(date +%s) - start )) s" >&2
exit "$rc"
