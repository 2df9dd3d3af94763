source .devrun/setup.sh
DEADLINE=400
echo "commit $TITAN_MEGAMOE_COMMIT"
mkdir -p $OUT/r
CFG=qwen3_30b_a3b_1gpu.toml
timeout 200 python3 -m titan_megamoe.cli ab --config $CFG --steps 30 --warmup 8 --no-deterministic --out $OUT/r/ab_bf16 --stock-args "--compile.enable" --mega-args "--compile.enable --mega_moe.precision fp8" > $OUT/r/ab_bf16.log 2>&1; echo "ab1 rc=$? left=$(left)"; grep -i "tok/s\|speedup\|ratio\|error" $OUT/r/ab_bf16.log | tail -8
timeout $(( $(left) - 15 )) python3 -m titan_megamoe.cli ab --config $CFG --steps 30 --warmup 8 --no-deterministic --out $OUT/r/ab_f8 --stock-args "--compile.enable --model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise" --mega-args "--compile.enable --mega_moe.precision fp8" > $OUT/r/ab_f8.log 2>&1; echo "ab2 rc=$? left=$(left)"; grep -i "tok/s\|speedup\|ratio\|error" $OUT/r/ab_f8.log | tail -8
cd $OUT && tar czf r.tgz r && rm -rf r
