# H100 (or H200): the full GPU test stage at the final commit (every GPU test file; test_fp8_kernels.py after the three groups on <100 GB)
source .devrun/setup.sh
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r
TESTS_LIMIT=${TESTS_LIMIT:-565} STAGES="gpu_tests" TAIL=6 bash scripts/gpu_acceptance.sh $OUT/r 2>&1 | tail -30
grep -E "passed|failed|error" $OUT/r/gpu_tests*.log | tail -8
cd $OUT && tar czf r.tgz r && rm -rf r
