# H100: the fixed tuner test (GPU candidates), then the layer benchmark over the default cases, bf16 and fp8, at the final commit
source .devrun/setup.sh
DEADLINE=${DEADLINE:-560}
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_tune.py -k "resume or tune_writes" > $OUT/r/test_tune.log 2>&1; echo "test_tune rc=$? left=$(left)"; tail -2 $OUT/r/test_tune.log
timeout $(( $(left) - 8 )) python3 scripts/bench_layer.py --cases 30b-512 30b-4k odd-777 mixtral-8k olmoe-8k 30b-16k-skewed 30b-16k-hot 30b-16k 235b-16k 30b-64k --precision bf16,fp8 --iters 10 --rounds 1 --max-seconds $(( $(left) - 60 )) --out $OUT/r > $OUT/r/bench_layer.log 2>&1; echo "bench rc=$? left=$(left)"
tail -40 $OUT/r/bench_layer.log | cut -c1-200
cd $OUT && tar czf r.tgz r && rm -rf r
