#!/usr/bin/env bash
# The GPU check, for a machine with one CUDA GPU (never part of the test suite):
#  1. ACCO's and DPU's exactness tests with CUDA tensors: W=1 over NCCL (the comm
#     thread on its own CUDA stream, ordered by events) and W=2 over gloo.
#  2. Short CLI runs of every strategy over NCCL (W=1) and over gloo with CUDA tensors (W=2).
# Usage: bash bench/gpu_check.sh [OUT_DIR]     (runs from the repository root, no install needed)
set -u
out=${1:-${OUT:-/tmp/lowcomm-gpu}}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
status=0
LOWCOMM_TEST_DEVICE=cuda LOWCOMM_TEST_BACKEND=nccl LOWCOMM_TEST_WORLD=1 \
  $py -m pytest -q -p no:cacheprovider tests/strategies/test_acco.py tests/strategies/test_dpu.py 2>&1 | tail -4 || status=1
LOWCOMM_TEST_DEVICE=cuda LOWCOMM_TEST_BACKEND=gloo LOWCOMM_TEST_WORLD=2 \
  $py -m pytest -q -p no:cacheprovider tests/strategies/test_acco.py tests/strategies/test_dpu.py 2>&1 | tail -4 || status=1
run() {  # name, flags...
  local name=$1; shift
  if $py -m lowcomm train --quiet --model small --micro-batch 16 --seq-len 256 --eval-every 0 \
       --out "$out/$name" --overwrite "$@" 2>"$out/$name.err"; then
    $py -c "import json,sys; d=json.load(open('$out/$name/summary.json')); print(f\"{'$name':16} {d['tokens_per_s']:>10,.0f} tok/s  val {d['final_val_loss']:.3f}  exposed {100*d['exposed_comm_fraction']:.1f}%  peak {d['peak_mem_bytes']/2**20:,.0f} MiB  extra {d.get('extra_memory_bytes_vs_zero1', 0)/2**20:.1f} MiB\")"
  else
    echo "$name FAILED:"; tail -5 "$out/$name.err"; status=1
  fi
}
for s in ddp zero1 acco dpu; do run "nccl-w1-$s" --strategy $s --workers 1 --backend nccl --steps 60; done
for s in zero1 acco; do run "gloo-cuda-w2-$s" --strategy $s --workers 2 --backend gloo --device cuda --steps 30; done
run "nccl-w1-acco-bf16" --strategy acco --workers 1 --backend nccl --steps 60 --param-dtype bf16
exit $status
