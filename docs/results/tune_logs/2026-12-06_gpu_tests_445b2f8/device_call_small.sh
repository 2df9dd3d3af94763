# H100, short: odd-777 and 30B T=512 bf16 again, three rounds (the previous call's single round read 0.82x / 0.91x)
source .devrun/setup.sh
DEADLINE=${DEADLINE:-100}
mkdir -p $OUT/r
timeout $(( $(left) - 6 )) python3 scripts/bench_layer.py --cases odd-777 30b-512 --precision bf16 --iters 20 --rounds 3 --max-seconds 60 --out $OUT/r > $OUT/r/bench_layer.log 2>&1; echo "bench rc=$? left=$(left)"
tail -12 $OUT/r/bench_layer.log | cut -c1-200
cd $OUT && tar czf r.tgz r && rm -rf r
