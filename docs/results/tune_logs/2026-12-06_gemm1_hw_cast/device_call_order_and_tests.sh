source .devrun/setup.sh
DEADLINE=275
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r/old $OUT/r/new2
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfs "tests/test_dx_pairs_one_loop.py::test_dx_pairs_in_one_loop_gpu" tests/test_fp8_rows_gluon.py::test_gluon_gemm1_compiles_with_two_wgmma_groups_in_flight tests/test_fp8_kernels.py::test_shipped_fp8_row_kernels_compile_to_fp8_wgmma_without_spills > $OUT/r/tests.log 2>&1; echo "tests rc=$? left=$(left)"; tail -4 $OUT/r/tests.log
B="python3 scripts/bench_layer.py --cases 30b-16k --precision bf16,fp8 --iters 20 --rounds 1 --max-seconds 60"
timeout 75 $B --out $OUT/r > $OUT/r/bench_new.log 2>&1; echo "new rc=$? left=$(left)"; grep "^\[bench" $OUT/r/bench_new.log | cut -c1-200
P=titan_megamoe/pipeline; cp $P/__init__.py /tmp/i.py; cp $P/expert_ffn.py /tmp/e.py; cp .devrun/old_order/__init__.py .devrun/old_order/expert_ffn.py $P/
timeout 55 $B --out $OUT/r/old > $OUT/r/bench_old.log 2>&1; echo "old rc=$? left=$(left)"; grep "^\[bench" $OUT/r/bench_old.log | cut -c1-200
cp /tmp/i.py $P/__init__.py; cp /tmp/e.py $P/expert_ffn.py
if [ $(left) -gt 50 ]; then timeout $(( $(left) - 4 )) $B --out $OUT/r/new2 > $OUT/r/bench_new2.log 2>&1; echo "new2 rc=$? left=$(left)"; grep "^\[bench" $OUT/r/bench_new2.log | cut -c1-200; fi
cd $OUT && tar czf r.tgz r && rm -rf r
