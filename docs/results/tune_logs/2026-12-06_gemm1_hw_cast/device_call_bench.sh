source .devrun/setup.sh
DEADLINE=585
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r/old
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
G=titan_megamoe/kernels/fp8_gemm1_ws_gluon.py
timeout 90 python3 scripts/bench_fp8_gluon.py --shapes 30b 235b --kernels gemm1 --gemm1-variants 6 7 --out $OUT/r > $OUT/r/g1_new.log 2>&1; echo "g1 new rc=$? left=$(left)"; grep -i "gemm1\|wrong" $OUT/r/g1_new.log | cut -c1-160 | tail -8
cp $G /tmp/g1_new.py; cp .devrun/gemm1_ws_old.py $G
timeout 90 python3 scripts/bench_fp8_gluon.py --shapes 30b 235b --kernels gemm1 --gemm1-variants 6 7 --out $OUT/r/old > $OUT/r/g1_old.log 2>&1; echo "g1 old rc=$? left=$(left)"; grep -i "gemm1\|wrong" $OUT/r/g1_old.log | cut -c1-160 | tail -8
if grep -q WRONG $OUT/r/g1_new.log; then echo "NEW GEMM1 WRONG: keeping the old file"; else cp /tmp/g1_new.py $G; fi
git diff --stat 2>/dev/null | tail -1; md5sum $G
timeout 150 python3 scripts/bench_layer.py --cases 30b-16k 235b-16k --precision bf16,fp8,fp8_bwd --iters 20 --rounds 2 --max-seconds 120 --out $OUT/r > $OUT/r/bench_layer.log 2>&1; echo "bench rc=$? left=$(left)"; grep -v Warning $OUT/r/bench_layer.log | grep "^\[bench" | cut -c1-200
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
F8="--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise"
timeout 170 python3 -m titan_megamoe.cli ab --config qwen3_30b_a3b_1gpu.toml --steps 30 --warmup 8 --no-deterministic --out $OUT/r/ab_fp8_vs_bf16 --stock-args "--compile.enable" --mega-args "--compile.enable --mega_moe.precision fp8" > $OUT/r/ab1.log 2>&1; echo "ab1 rc=$? left=$(left)"; tail -22 $OUT/r/ab1.log
timeout $(( $(left) - 15 )) python3 -m titan_megamoe.cli ab --config qwen3_30b_a3b_1gpu.toml --steps 30 --warmup 8 --no-deterministic --out $OUT/r/ab_fp8_vs_float8 --stock-args "--compile.enable $F8" --mega-args "--compile.enable --mega_moe.precision fp8" > $OUT/r/ab2.log 2>&1; echo "ab2 rc=$? left=$(left)"; tail -22 $OUT/r/ab2.log
fi
cd $OUT && du -sh r; tar czf r.tgz --exclude='*checkpoint*' r && rm -rf r; ls -la
