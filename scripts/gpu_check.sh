#!/usr/bin/env bash
# One device call's worth of GPU checks (about 4 minutes on an H200), from the root of a tree that
# travelled with `.gpu/` packed by ../shared/gpu/build.sh:
#   device run, command: bash scripts/gpu_check.sh     carry: [".gpu"]
# 1. every `cuda::` test outside the kernel file (the kernels on by default); beside it, each
#    kernel test as a process of its own (their lock serialises them within one), and
#    compute-sanitizer (memcheck, then racecheck) on single kernel tests, 4 at a time;
# 2. then, alone on the GPU, the crate's bench (the kernels alone) and PyTorch's SDPA.
# Logs go to $OUT (at most 8 files come back); the output's tail is the summary.
# Environment: CHECK_SECONDS caps each test process (default 90), BENCH (0 skips step 2).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
cap=${CHECK_SECONDS:-90}
t0=$SECONDS
say() { echo "== [$((SECONDS - t0)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || { echo "no GPU"; exit 1; }
libs=$(find / -xdev \( -name 'libcublas.so.13' -o -name 'libcublasLt.so.13' -o -name 'libcurand.so.10' \
  -o -name 'libnvrtc.so.13' -o -name 'libcudart.so.13' \) -printf '%h\n' 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:-}"
B=/tmp/gpu-bin; rm -rf "$B"; mkdir -p "$B"; tar -xJf .gpu/bin.tar.xz -C "$B" || exit 1
crate=$(cat "$B/crate-path"); tree=$(realpath "$PWD")
if [ "$crate" != "$tree" ] && [ ! -e "$crate" ]; then mkdir -p "$(dirname "$crate")"; ln -s "$tree" "$crate"; fi
L=/tmp/gpu-logs; rm -rf "$L"; mkdir -p "$L"
K=cuda::kernel::cuda::
kernel_tests=$(timeout 30 "$B/tests/it" "$K" --list 2>/dev/null | sed -n 's/: test$//p')
say "unpacked; $(echo "$kernel_tests" | wc -w) kernel tests"

# 1. Tests and sanitizers side by side. Every job is waited for by its pid: a bare `wait` would
#    also wait for any process substitution and never return.
pids=()
timeout "$cap" "$B/tests/it" cuda:: --skip "$K" --test-threads=8 > "$OUT/tests.log" 2>&1 & pids+=($!)
timeout "$cap" "$B/tests/lib" cuda:: --test-threads=4 > "$L/lib.log" 2>&1 & pids+=($!)
for t in $kernel_tests; do
  timeout "$cap" "$B/tests/it" "$t" --exact > "$L/test_${t##*::}.log" 2>&1 & pids+=($!)
done
{ for t in $kernel_tests; do echo "memcheck $t"; done
  for t in $kernel_tests; do echo "racecheck $t"; done; } |
  timeout $((cap * 2)) xargs -P 4 -L 1 sh -c 'timeout '"$cap"' compute-sanitizer --tool "$0" \
    --error-exitcode 9 '"$B"'/tests/it "$1" --exact --test-threads=1 > '"$L"'/"$0"_"${1##*::}".log 2>&1' &
pids+=($!)
wait "${pids[@]}"
say "tests and sanitizers done"

# The summary: one line per test process and sanitizer run, then every failure's message.
{
  echo "## outside the kernel file"; grep -E '^test result' "$OUT/tests.log"; grep -E 'FAILED$' "$OUT/tests.log"
  echo "## library"; grep -E '^test result' "$L/lib.log"
  for f in "$L"/test_*.log "$L"/memcheck_*.log "$L"/racecheck_*.log; do
    [ -e "$f" ] || continue
    n=$(basename "$f" .log)
    echo "$n: $(grep -E '^test result' "$f" | sed 's/test result: //; s/;.*//' | tr '\n' ' ')$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tr '\n' ' ')"
  done
} > "$OUT/summary.log"
for f in "$OUT/tests.log" "$L"/test_*.log; do
  grep -A6 '^---- ' "$f" | grep -vE '^ *[0-9]+: |^ *at |^note: |^stack backtrace'
done > "$OUT/failures.log"
for f in "$L"/memcheck_*.log "$L"/racecheck_*.log; do
  grep -qE 'ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9]' "$f" && { echo "### $f"; head -80 "$f"; }
done > "$OUT/sanitizer_errors.log"
cat "$OUT/summary.log"
[ "${BENCH:-1}" = 0 ] && exit 0

# 2. Benches, alone: ours, then PyTorch's in a process of its own.
timeout 120 "$B/benches/attention" --bench --only cuda --max-t 4096 --kernel-only --json \
  > "$OUT/bench_ours.log" 2>&1
say "our bench: exit $?"
PYTHONUNBUFFERED=1 timeout 150 python3 benches/pytorch_baseline.py --device cuda --max-t 4096 \
  --sdpa-only --json > "$OUT/bench_torch.log" 2>&1
say "PyTorch's: exit $?"
