#!/usr/bin/env bash
# The block (B2 H8 T1024 D64, f32, 2 threads) as a user's process runs it, the crate's and
# PyTorch's alternated case by case: each figure is one fresh process's median of 9 calls after
# two, ROUNDS rounds, then each case's median over the rounds and their ratio.
#   train: a training step (forward and backward to the input and every weight; the block on a
#          `VarMap`): `attention --train-steps-child`, `pytorch_baseline.py --train-step`;
#   infer: an inference forward (the block from plain tensors): `attention --infer-steps-child`,
#          `pytorch_baseline.py --infer-step`.
# Needs the Python of benches/pytorch_baseline.py (PYTHON, default python3). Run it on a quiet
# machine: nothing else may run beside it.
#
# usage: scripts/rounds.sh train|infer [ROUNDS] [CASE...]   (cases default: none rope alibi t5
#        clipped_bias shaw_k64; each bidirectional and causal)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/rounds.sh train|infer [ROUNDS] [CASE...]}
case "$mode" in
  train|infer) ;;
  *) echo "unknown mode $mode (train or infer)" >&2; exit 2 ;;
esac
shift
rounds=${1:-3}
shift || true
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(none rope alibi t5 clipped_bias shaw_k64)
python=${PYTHON:-python3}
cargo bench --bench attention --no-run -q
bench=$(ls -t "${CARGO_TARGET_DIR:-target}"/release/deps/attention-* | grep -v '\.d$' | head -1)
out=$(mktemp)
for r in $(seq 1 "$rounds"); do
  for causal in false true; do
    for name in "${cases[@]}"; do
      crate=$("$bench" --bench "--$mode-steps-child" "$name" 1024 "$causal" | tail -1)
      torch=$("$python" benches/pytorch_baseline.py "--$mode-step" "$name" "$causal" | tail -1)
      printf 'round %s %-13s causal=%-5s crate %7.2f ms  PyTorch %7.2f ms\n' \
        "$r" "$name" "$causal" "$crate" "$torch"
      echo "$name $causal $crate $torch" >> "$out"
    done
  done
done
echo
"$python" - "$out" "$mode" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, causal, crate, torch = line.split()
    rows.setdefault((name, causal), ([], []))
    rows[(name, causal)][0].append(float(crate))
    rows[(name, causal)][1].append(float(torch))
print(f"{sys.argv[2]:<6}{'case':<28} {'crate ms':>9} {'PyTorch ms':>11} {'ratio':>7}  (medians over the rounds)")
for (name, causal), (c, t) in rows.items():
    a, b = statistics.median(c), statistics.median(t)
    print(f"      {name + ' causal=' + causal:<28} {a:>9.2f} {b:>11.2f} {a / b:>6.2f}x")
PY
rm -f "$out"
