source .devrun/setup.sh
DEADLINE=570
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r/div
timeout 60 python3 -m pytest -q -m gpu tests/test_fp8_rows_gluon.py -k "match_the_triton and TruexTrue" -p no:cacheprovider > $OUT/r/tests_rows.log 2>&1; echo "tests rows rc=$? left=$(left)"; tail -n 1 $OUT/r/tests_rows.log; grep FAILED $OUT/r/tests_rows.log | head -5
timeout 170 python3 -m pytest -q tests/test_fp8_dswiglu_split.py tests/test_e4m3_scale.py tests/test_quant_kernels.py -p no:cacheprovider > $OUT/r/tests_q.log 2>&1; echo "tests q rc=$? left=$(left)"; tail -n 1 $OUT/r/tests_q.log; grep FAILED $OUT/r/tests_q.log | head -8
timeout 130 python3 scripts/bench_row_kernels.py --sections fp8_dswiglu token_tiles --quick --out $OUT/r > $OUT/r/bench_q.log 2>&1; echo "bench q rc=$? left=$(left)"; grep "fp8 dswiglu\|token tiles" $OUT/r/bench_q.log | cut -c1-140
cp titan_megamoe/kernels/common.py /tmp/common_bits.py; cp .devrun/common_div.py titan_megamoe/kernels/common.py
timeout 100 python3 scripts/bench_row_kernels.py --sections fp8_dswiglu token_tiles --quick --out $OUT/r/div > $OUT/r/bench_q_div.log 2>&1; echo "bench q div rc=$? left=$(left)"; grep "fp8 dswiglu\|token tiles" $OUT/r/bench_q_div.log | cut -c1-140
cp /tmp/common_bits.py titan_megamoe/kernels/common.py
timeout $(( $(left) - 12 )) python3 scripts/bench_fp8_gluon.py --shapes 30b 235b --kernels gemm2 dgrad_q dx --variants 8 11 --out $OUT/r > $OUT/r/bench_rows.log 2>&1; echo "bench rows rc=$? left=$(left)"; grep -v Warn $OUT/r/bench_rows.log | cut -c1-120 | tail -14
cd $OUT && tar czf r.tgz r && rm -rf r
