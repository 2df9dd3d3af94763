# H100 (or H200): the full GPU test stage and the symmetric-memory one-rank check at the final commit
source .devrun/setup.sh
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r
TESTS_LIMIT=${TESTS_LIMIT:-420} STAGES="gpu_tests symm_mem_one_gpu" TAIL=6 bash scripts/gpu_acceptance.sh $OUT/r 2>&1 | tail -30
grep -E "passed|failed|error" $OUT/r/gpu_tests.log | tail -8
cd $OUT && tar czf r.tgz r && rm -rf r
