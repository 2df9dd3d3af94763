"""Compile the block-FP8 row kernels for sm_90 on the CPU and report registers, stack bytes (spills) and
the FP8 wgmma count (QGMMA in the SASS), using Triton's bundled ptxas and cuobjdump: no GPU needed.

    env -u TRITON_INTERPRET python scripts/sm90_resources.py            # every row of docs/kernels.md
    env -u TRITON_INTERPRET python scripts/sm90_resources.py "dgrad shipped"

The local Triton may differ from the GPU machine's, so this is a guide to register pressure, not the
binary that runs there. (The wgrad kernels have the same check in tests/test_wgrad_fp8.py.)
"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from titan_megamoe.kernels import gemm1_swiglu as G1, grouped_gemm as GG, dgrad_swiglu as DG

def compile_sm90(fn, sig, constexprs, warps, stages):
    signature = {**sig, **dict.fromkeys(constexprs, "constexpr")}
    aligned = {n for n, t in sig.items() if t.startswith("*") or t == "i32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in aligned}
    k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    u = re.sub(r"\s+", " ", usage[usage.find("REG:"):]).strip()
    return f"QGMMA {sass.count('QGMMA')} HGMMA {sass.count('HGMMA')} {u[:60]} smem {k.metadata.shared}"

P = lambda names, t: dict.fromkeys(names, t)
def gemm1(bn, w, s, tma, atma=True):
    sig = {**({"x_ptr": "tensordesc<fp8e4nv[128, 128]>"} if atma else P(["x_ptr"], "*fp8e4nv")), **({"w1_ptr": f"tensordesc<fp8e4nv[{bn}, 128]>", "w3_ptr": f"tensordesc<fp8e4nv[{bn}, 128]>"} if tma else P(["w1_ptr", "w3_ptr"], "*fp8e4nv")),
           **P(["order_ptr", "tile_expert_ptr", "tile_row_ptr", "offsets_ptr"], "*i32"), **P(["g_ptr", "u_ptr"], "*bf16"), "h_ptr": "*fp8e4nv",
           **P(["xs_ptr", "w1s_ptr", "w3s_ptr", "hs_ptr"], "*fp32"), **P(["D", "H", "rows_per_token", "stride_xt", "stride_we", "stride_wh"], "i32")}
    return compile_sm90(G1._gemm1_swiglu_kernel, sig, dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=128, A_TMA=atma, W_TMA=tma, FP8=True, INTERPRET=False), w, s)
def gg(bn, w, s, two, ws=False):
    d = lambda r: f"tensordesc<fp8e4nv[{r}, 128]>"
    sig = {"a1_ptr": d(128), "b1_ptr": d(bn), "a2_ptr": d(128), "b2_ptr": d(bn), **P(["order_ptr", "tile_expert_ptr", "tile_row_ptr", "offsets_ptr"], "*i32"),
           "out_ptr": "*bf16", **P(["a1s_ptr", "b1s_ptr", "a2s_ptr", "b2s_ptr"], "*fp32"), **P(["KD", "ND", "stride_be", "stride_bk", "stride_bn"], "i32")}
    return compile_sm90(GG._grouped_gemm_kernel, sig, dict(TWO_PAIRS=two, TMA=True, B_TRANS=True, WS=ws, BLOCK_M=128, BLOCK_N=bn, BLOCK_K=128, FP8=True, INTERPRET=False), w, s)
def dgrad(w, s, atma=True, btma=True):
    sig = {"dout_ptr": "tensordesc<fp8e4nv[128, 128]>" if atma else "*fp8e4nv", "w2_ptr": "tensordesc<fp8e4nv[64, 128]>" if btma else "*fp8e4nv", **P(["g_ptr", "u_ptr"], "*bf16"), "scores_ptr": "*fp32", **P(["order_ptr", "tile_expert_ptr", "tile_row_ptr", "offsets_ptr"], "*i32"),
           **P(["dg_ptr", "du_ptr", "hs_ptr"], "*fp8e4nv"), "ds_part_ptr": "*fp32", **P(["douts_ptr", "w2s_ptr", "dgs_ptr", "dus_ptr"], "*fp32"),
           "dgt_ptr": "*fp8e4nv", "dgt_s_ptr": "*fp32", "dut_ptr": "*fp8e4nv", "dut_s_ptr": "*fp32", "hst_ptr": "*fp8e4nv", "hst_s_ptr": "*fp32",
           **P(["P", "D", "H", "rows_per_token", "stride_dt", "stride_we", "stride_wk", "stride_wn"], "i32")}
    return compile_sm90(DG._dgrad_swiglu_kernel, sig, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, STORE_Q=False, A_TMA=atma, B_TMA=btma, FP8=True, INTERPRET=False), w, s)
jobs = {
    "gemm1 shipped 2x64 halves": lambda: gemm1(64, 8, 3, True),
    "gemm2 first version 256": lambda: gg(256, 8, 3, False),
    "gemm2 shipped 128": lambda: gg(128, 8, 3, False),
    "dx shipped 128": lambda: gg(128, 8, 3, True),
    "dgrad gathered x": lambda: dgrad(8, 3, atma=False, btma=False),
    "dgrad shipped": lambda: dgrad(8, 3),
}


def dgrad_mainloop_only(w, s):
    """The FP8 dgrad main loop with the split-mode epilogue (q stored): what the loop alone costs."""
    sig = {"dout_ptr": "tensordesc<fp8e4nv[128, 128]>", "w2_ptr": "tensordesc<fp8e4nv[64, 128]>", **P(["g_ptr", "u_ptr"], "*bf16"),
           "scores_ptr": "*fp32", **P(["order_ptr", "tile_expert_ptr", "tile_row_ptr", "offsets_ptr"], "*i32"),
           **P(["dg_ptr", "du_ptr", "hs_ptr"], "*bf16"), "ds_part_ptr": "*fp32", **P(["douts_ptr", "w2s_ptr", "dgs_ptr", "dus_ptr"], "*fp32"),
           "dgt_ptr": "*fp8e4nv", "dgt_s_ptr": "*fp32", "dut_ptr": "*fp8e4nv", "dut_s_ptr": "*fp32", "hst_ptr": "*fp8e4nv", "hst_s_ptr": "*fp32",
           **P(["P", "D", "H", "rows_per_token", "stride_dt", "stride_we", "stride_wk", "stride_wn"], "i32")}
    return compile_sm90(DG._dgrad_swiglu_kernel, sig, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, STORE_Q=True, A_TMA=True,
                                                           B_TMA=True, FP8=True, INTERPRET=False), w, s)


jobs["dgrad main loop only"] = lambda: dgrad_mainloop_only(8, 3)
if __name__ == "__main__":
    for name in sys.argv[1:] or jobs:
        try:
            print(f"{name:28s}", jobs[name](), flush=True)
        except Exception as e:
            print(f"{name:28s} ERROR {str(e)[:300]}", flush=True)
