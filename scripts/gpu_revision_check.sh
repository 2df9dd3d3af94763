#!/usr/bin/env bash
# A refactor's GPU acceptance in one go (one H200, ~9 minutes): same numbers and same speed as a base revision.
#   1. fingerprints of every output and gradient on the GPU test shapes, base and this checkout, compared
#      (scripts/compare_revisions.py: bitwise equal or not, per tensor)
#   2. the layer benchmark (scripts/bench_layer.py) of base, this checkout, this checkout, base (ABBA, so a
#      drift of the machine during the run shows as a difference between the two runs of one revision)
#   3. the kernel, routing, router, weight-gradient and eager-path tests of this checkout
# Usage: scripts/gpu_revision_check.sh BASE_DIR BASE_COMMIT OUT_DIR [bench cases...]
#   BASE_DIR holds the base revision's titan_megamoe/ (git archive BASE titan_megamoe | tar -x -C BASE_DIR);
#   TITAN_MEGAMOE_COMMIT names this checkout's commit where .git does not travel.
#   BENCH_ARGS: more bench_layer.py options for all four runs (e.g. --full-ac: the layer under full activation
#   checkpointing too, which a base from before that option times as well; --sac needs a base with
#   `converter.sac_save_ops`, 6f06af2 on).
set -u
base=$1 base_commit=$2 out=$3
shift 3
cases=${*:-30b-16k 235b-16k}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
site=${SITE:-}
here_commit=${TITAN_MEGAMOE_COMMIT:-unknown}
stage() {  # name, time limit (s), PYTHONPATH, commit, command...
  local name=$1 limit=$2 path=$3 commit=$4; shift 4
  echo "=== $name (limit ${limit}s)"
  PYTHONPATH="$path${site:+:$site}" TITAN_MEGAMOE_COMMIT=$commit timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "=== $name rc=$?"
  tail -n "${TAIL:-4}" "$out/$name.log"
}
stage fingerprint_base 150 "$base" "$base_commit" python3 scripts/compare_revisions.py --save "$out/fp_base.json"
stage fingerprint_here 150 . "$here_commit" python3 scripts/compare_revisions.py --save "$out/fp_here.json"
TAIL=70 stage compare 60 . "$here_commit" python3 scripts/compare_revisions.py --compare "$out/fp_base.json" \
  "$out/fp_here.json" --out "$out"
i=0
for rev in base here here base; do
  i=$((i + 1))
  if [ $rev = base ]; then path=$base commit=$base_commit; else path=. commit=$here_commit; fi
  # shellcheck disable=SC2086
  stage "bench${i}_$rev" "${BENCH_LIMIT:-110}" "$path" "$commit" python3 scripts/bench_layer.py --cases $cases \
    --iters 20 ${BENCH_ARGS:-} --out "$out/bench_$rev"
done
TAIL=12 stage gpu_tests "${TESTS_LIMIT:-240}" . "$here_commit" python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_gpu_kernels.py tests/test_routing.py tests/test_router.py tests/test_kernel_wgrad.py tests/test_eager_path.py
