#!/usr/bin/env bash
# On one GPU, in one command: Transformer-base's step profiled by kind of kernel, then timed against PyTorch
# eager and torch.compile beside the levers that bound what a cut can win, then Transformer-big's MFU.
#
#   benchmarks/gpu_step_check.sh ["--software_note=why the software is outside the pins"]
#
# About 7 minutes on one H100 (each JAX step compiles in ~35 s, torch.compile in ~50 s); each part stops
# at its own limit, 8 minutes in all. Writes three records under docs/results/ (common/records.py):
#   step_profile_base_gpu           the kernel-kind table and its unattributed share (benchmarks/step_profile.py);
#   peer_throughput_base_gpu        step ms, MFU, ratios to PyTorch eager and torch.compile, for the default step
#                                   and its bounds: every dropout rate at 0 (attention dropout is 0 already
#                                   in configs/default.py), XLA's attention instead of cuDNN's, twice the batch;
#   accelerator_check_big_gpu       Transformer-big's step and its largest batch, with their MFU.
# Arguments go to all three (a GPU image's jax is outside pyproject.toml's pins: records need
# --software_note). Needs a CUDA build of PyTorch and, on the lent machines' image, the wheels of
# ../shared/gpu-wheels.sh installed on PYTHONPATH (ml_collections, absl-py, grain, ...); docs/speed.md says how.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=0

part() {  # part SECONDS COMMAND...: runs it under its time limit, says how long it took, carries on if it fails.
  local limit=$1 start=$SECONDS
  shift
  echo "== $* (limit ${limit} s)"
  timeout "$limit" "$@" || { echo "== failed with status $?: $*"; failed=1; }
  echo "== $((SECONDS - start)) s"
}

part 100 python3 -m benchmarks.step_profile --model=base --steps=10 "$@"
part 260 python3 -m benchmarks.peer_throughput --model=base --rounds=3 --steps=20 \
  --variants=default,model.dropout_rate=0.0,model.attention_implementation=xla,per_device_batch_size=192 "$@"
part 120 python3 -m benchmarks.accelerator_check --sizes=big --sections=step,max_batch "$@"
exit $failed
