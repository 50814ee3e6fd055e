#!/usr/bin/env bash
# Regenerates the README's bench figure and table: the default `lowcomm bench` (what `make bench`
# runs), its loss-vs-time plot copied to docs/bench_loss_vs_time.png. Paste the printed table into
# the README's "Comparing strategies" section. Usage: docs/regenerate_bench.sh [extra bench flags]
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/readme-bench
python -m lowcomm bench --out "$out" --overwrite --quiet "$@"
cp "$out/loss_vs_time.png" docs/bench_loss_vs_time.png
echo "docs/bench_loss_vs_time.png updated from $out"
