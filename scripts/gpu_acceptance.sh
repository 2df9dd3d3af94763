#!/usr/bin/env bash
# The GPU measurements the docs quote, in one go (one H200; about 10 minutes):
#   1. the kernel, routing and router tests at real shapes, 2. the per-layer benchmark (JSON under docs/results/),
#   3. the A/B on the debug model (30 steps), 4. the A/B on Qwen3-30B-A3B shapes on one GPU (50 steps).
# Usage: scripts/gpu_acceptance.sh OUT_DIR [steps per stage...]. Each stage has its own time limit so one
# slow stage cannot starve the rest; a stage that fails is reported and the next one still runs.
set -u
out=${1:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
stage() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"
  tail -n "${TAIL:-14}" "$out/$name.log"
}
stage gpu_tests "${TESTS_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
  tests/test_routing.py tests/test_router.py ${TESTS_K:+-k "$TESTS_K"}
stage bench 560 python3 scripts/bench_layer.py --sac --iters 20 --precision bf16,fp8,fp8_bwd --max-seconds 480
stage ab_debug 130 python3 -m titan_megamoe.cli ab --config qwen3_moe_debug.toml --steps 30 --warmup 5 \
  --no-deterministic --out "$out/ab_debug"
stage ab_30b_1gpu "${AB30_LIMIT:-290}" python3 -m titan_megamoe.cli ab --config qwen3_30b_a3b_1gpu.toml --steps 50 \
  --warmup 5 --no-deterministic --out "$out/ab_30b_1gpu"
