source .devrun/setup.sh
DEADLINE=210
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r/clamp
timeout 55 python3 scripts/bench_row_kernels.py --sections fp8_dswiglu token_tiles --quick --out $OUT/r > $OUT/r/bench_q.log 2>&1; echo "bench q rc=$? left=$(left)"; grep "fp8 dswiglu gluon\|token tiles.*4w hardware" $OUT/r/bench_q.log | cut -c1-120
cp titan_megamoe/kernels/quantize_gluon.py /tmp/qg_new.py; cp .devrun/quantize_gluon_clamp.py titan_megamoe/kernels/quantize_gluon.py
timeout 55 python3 scripts/bench_row_kernels.py --sections fp8_dswiglu token_tiles --quick --out $OUT/r/clamp > $OUT/r/bench_q_clamp.log 2>&1; echo "bench q clamp rc=$? left=$(left)"; grep "fp8 dswiglu gluon\|token tiles.*4w hardware" $OUT/r/bench_q_clamp.log | cut -c1-120
cp /tmp/qg_new.py titan_megamoe/kernels/quantize_gluon.py
timeout $(( $(left) - 8 )) python3 scripts/bench_layer.py --cases 30b-16k 235b-16k --precision bf16,fp8 --iters 20 --rounds 2 --max-seconds 80 --out $OUT/r > $OUT/r/bench_layer.log 2>&1; echo "bench rc=$? left=$(left)"; grep -v Warning $OUT/r/bench_layer.log | grep "^\[bench"
cd $OUT && tar czf r.tgz r && rm -rf r
