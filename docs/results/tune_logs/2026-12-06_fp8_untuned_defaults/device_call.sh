# H100: dSwiGLU reload timing + its tests; FP8 defaults for untuned shapes (Gluon WS, group_m for large experts)
source .devrun/setup.sh
DEADLINE=575
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r/new $OUT/r/triton $OUT/r/g1 $OUT/r/reload
timeout 100 python3 scripts/bench_row_kernels.py --sections fp8_dswiglu --quick --out $OUT/r > $OUT/r/bench_q.log 2>&1; echo "bench q rc=$? left=$(left)"; grep "fp8 dswiglu" $OUT/r/bench_q.log | cut -c1-140
K='128x256x8x3xTruexNonex4 or 128x128x8x4xTruexTruex3 or 128x128x8x3xTruex4 or 128x64x8x3xTruex16'
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_fp8_dswiglu_split.py tests/test_fp8_kernels.py::test_fp8_real_shapes "tests/test_fp8_rows_gluon.py" -k "not test_gluon_ or ($K)" > $OUT/r/tests.log 2>&1; echo "tests rc=$? left=$(left)"; tail -4 $OUT/r/tests.log
B="python3 scripts/bench_layer.py --iters 10 --rounds 1"
timeout 130 $B --cases mixtral-8k olmoe-8k --precision bf16,fp8 --max-seconds 110 --out $OUT/r/new > $OUT/r/layer_new.log 2>&1; echo "layer new rc=$? left=$(left)"; grep "^\[bench" $OUT/r/layer_new.log | cut -c1-220
timeout 100 $B --cases mixtral-8k olmoe-8k --precision fp8 --max-seconds 80 --tile-table .devrun/t_triton.json --out $OUT/r/triton > $OUT/r/layer_triton.log 2>&1; echo "layer triton rc=$? left=$(left)"; grep "^\[bench" $OUT/r/layer_triton.log | cut -c1-220
if [ $(left) -gt 70 ]; then timeout $(( $(left) - 8 )) $B --cases mixtral-8k --precision fp8 --max-seconds 40 --tile-table .devrun/t_g1.json --out $OUT/r/g1 > $OUT/r/layer_g1.log 2>&1; echo "layer g1 rc=$? left=$(left)"; grep "^\[bench" $OUT/r/layer_g1.log | cut -c1-220; fi
cd $OUT && tar czf r.tgz r && rm -rf r
