source .devrun/setup.sh
DEADLINE=585
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r
TESTS_LIMIT=540 STAGES=gpu_tests timeout 560 bash scripts/gpu_acceptance.sh $OUT/r > $OUT/r/acc.log 2>&1; echo "acc rc=$? left=$(left)"; tail -30 $OUT/r/acc.log
grep -h -E "passed|failed|error" $OUT/r/gpu_tests.log | tail -8
cd $OUT && tar czf r.tgz r && rm -rf r
