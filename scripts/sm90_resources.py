"""Compile Triton kernels for sm_90 on the CPU and report registers, stack bytes (spills) and the wgmma
count in the SASS (QGMMA: FP8, HGMMA: bf16), with Triton's bundled ptxas and cuobjdump: no GPU needed.

    env -u TRITON_INTERPRET python scripts/sm90_resources.py            # every row of docs/kernels.md
    env -u TRITON_INTERPRET python scripts/sm90_resources.py "dgrad q 64 rows 4 warps"

`compile_sm90` is also what the weight-gradient tests use (tests/test_kernel_wgrad.py, test_wgrad_fp8.py) to
check the shipped configs; `shipped_fp8_rows` and `shipped_bf16_rows` compile the row GEMMs with the table's
configs for a (D, H) (tests/test_fp8_kernels.py, tests/test_bf16_sm90_compile.py). Run it without
TRITON_INTERPRET: under the interpreter triton's own library functions are interpreted too and nothing
compiles. The local Triton may differ from the GPU machine's, so this is a guide to register pressure, not the
binary that runs there. To compile with the GPU machine's Triton (3.6) on a host that has another, put that
wheel on the path first:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    env -u TRITON_INTERPRET PYTHONPATH=/tmp/t36 python scripts/sm90_resources.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, signature: dict, constexprs: dict, aligned: set, num_warps: int, num_stages: int,
                 source=ASTSource, maxnreg: int | None = None) -> dict:
    """Compile jitted `fn` for sm_90 with these argument types (`signature`, the constexprs excluded) and
    16-byte divisibility on the `aligned` arguments; returns what the SASS and resource usage say.

    Arguments named in neither `signature` nor `constexprs` are None constexprs, as a launch that passes
    None specialises them (the second operand pair, the EP-only pointers), so a kernel that gains such an
    argument still compiles here. The signature is put in the kernel's argument order, which the
    divisibility attributes index."""
    unknown = (set(signature) | set(constexprs)) - set(fn.arg_names)
    assert not unknown, f"{fn.__name__} has no arguments {sorted(unknown)}"
    constexprs = {**{n: None for n in fn.arg_names if n not in signature and n not in constexprs}, **constexprs}
    signature = {n: signature.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in aligned}
    k = triton.compile(source(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages,
                                    **({"maxnreg": maxnreg} if maxnreg else {})))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return dict(wgmma_ir="warp_group_dot" in k.asm["ttgir"], qgmma=sass.count("QGMMA"), hgmma=sass.count("HGMMA"),
                usage=re.sub(r"\s+", " ", usage[usage.find("REG:"):]).strip(), smem=k.metadata.shared,
                global_proxy_fences=k.asm["ptx"].count("fence.proxy.async.global"),
                wgmma_waits=re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", k.asm["ptx"]),
                e4m3_casts=k.asm["ptx"].count("cvt.rn.satfinite.e4m3x2.f32"),
                global_stores=dict(Counter(re.findall(r"st\.global((?:\.v\d)?\.b\d+)", k.asm["ptx"]))),
                # loops left in the TTGIR whose bodies hold an MMA: 1 when a persistent tile loop is fused
                # with its K loop (or there is one K loop), 2 for dx's two passes, more when nested
                mma_loops=_mma_loops(k.asm["ttgir"]))


def _mma_loops(ttgir: str) -> int:
    """How many `scf.for` bodies contain a `warp_group_dot`, directly or in a nested region (a tile loop
    around K loops counts with them). Braces are matched in order: attribute dictionaries open and close
    on one line."""
    count, stack = 0, []  # per open region: [is a for loop's body, holds an MMA]
    for line in ttgir.splitlines():
        if "warp_group_dot " in line:
            for frame in stack:
                frame[1] = True
        last_open = line.rfind("{") if " scf.for " in f" {line.strip()} " else -1
        for i, ch in enumerate(line):
            if ch == "{":
                stack.append([i == last_open, False])
            elif ch == "}" and stack:
                is_for, has_mma = stack.pop()
                count += is_for and has_mma
    return count


# ---------------------------------------------------------------- the FP8 row kernels, as the launchers call them

def _types(names: str, t: str) -> dict:
    return dict.fromkeys(names.split(), t)


def _fp8_desc(rows: int) -> str:
    return f"tensordesc<fp8e4nv[{rows}, 128]>"


PLAN = _types("order_ptr tile_expert_ptr tile_row_ptr offsets_ptr", "*i32")


def _row_kernel(fn, signature, constexprs, num_warps=8, num_stages=3):
    aligned = {n for n, t in signature.items() if t.startswith("*") or t == "i32"}
    return compile_sm90(fn, signature, {**constexprs, "INTERPRET": False}, aligned, num_warps, num_stages)


def gemm1(block_n: int, w_tma: bool = True, a_tma: bool = True, block_m: int = 128, num_warps: int = 8,
          num_stages: int = 3, group_m: int = 1, bf16: bool = False, block_k: int = 128):
    """GEMM1 + SwiGLU, block FP8 unless `bf16` (then x gathered by pointer unless `a_tma`, no scales)."""
    from titan_megamoe.kernels.gemm1_swiglu import _gemm1_swiglu_kernel

    if bf16:
        w = f"tensordesc<bf16[{block_n}, {block_k}]>" if w_tma else "*bf16"
        sig = {"x_ptr": f"tensordesc<bf16[{block_m}, {block_k}]>" if a_tma else "*bf16", "w1_ptr": w, "w3_ptr": w,
               **PLAN, **_types("g_ptr u_ptr h_ptr", "*bf16")}
    else:
        w = _fp8_desc(block_n) if w_tma else "*fp8e4nv"
        sig = {"x_ptr": _fp8_desc(block_m) if a_tma else "*fp8e4nv", "w1_ptr": w, "w3_ptr": w, **PLAN,
               **_types("g_ptr u_ptr", "*bf16"), "h_ptr": "*fp8e4nv",
               **_types("xs_ptr w1s_ptr w3s_ptr hs_ptr", "*fp32"), **_types("arrived_ptr expected_ptr", "*i32")}
    sig.update(_types("D H rows_per_token stride_xt stride_we stride_wh", "i32"))
    return _row_kernel(_gemm1_swiglu_kernel, sig, dict(BLOCK_M=block_m, SUB_TILES=128 // block_m, GROUP_M=group_m,
                                                       BLOCK_N=block_n, BLOCK_K=block_k, A_TMA=a_tma, W_TMA=w_tma,
                                                       FP8=not bf16, WAIT=False), num_warps, num_stages)


def dgrad_bf16(block_n: int, block_k: int, w_tma: bool, store_q: bool, block_m: int = 128, num_warps: int = 8,
               num_stages: int = 4, group_m: int = 1):
    """bf16 dgrad's fused kernel (dout gathered by pointer, two accumulators): q stored for the rows kernel
    (`store_q`, the split mode) or the dSwiGLU in its epilogue; W2 by pointer or through two TMA descriptors."""
    from titan_megamoe.kernels.dgrad_swiglu import _dgrad_swiglu_kernel

    w = f"tensordesc<bf16[{block_k}, {block_n}]>" if w_tma else "*bf16"
    sig = {"dout_ptr": "*bf16", "w2_ptr": w, **_types("g_ptr u_ptr", "*bf16"), "scores_ptr": "*fp32", **PLAN,
           **_types("dg_ptr du_ptr hs_ptr", "*bf16"), "ds_part_ptr": "*fp32",
           **_types("D H rows_per_token stride_dt stride_we stride_wk stride_wn", "i32"),
           **({"w2_next_ptr": w} if w_tma else {})}
    return _row_kernel(_dgrad_swiglu_kernel, sig, dict(BLOCK_M=block_m, SUB_TILES=128 // block_m, GROUP_M=group_m,
                                                       BLOCK_N=block_n, BLOCK_K=block_k, STORE_Q=store_q, WAIT=False,
                                                       W_TMA=w_tma), num_warps, num_stages)


def grouped_gemm(block_n: int, two_pairs: bool, block_m: int = 128, num_warps: int = 8, sorted_out: bool = False,
                 num_stages: int = 3, group_m: int = 1, persistent: bool = False, bf16: bool = False, block_k: int = 128,
                 one_loop: bool = False):
    """The row-tiled GEMM (FP8 unless `bf16`, both operands through TMA): GEMM2, dx (`two_pairs`) or dgrad's q
    (`sorted_out`); `persistent`: resident programs walking the tiles; `one_loop`: dx's pairs in one K loop."""
    from titan_megamoe.kernels.grouped_gemm import _grouped_gemm_kernel

    if bf16:  # GEMM2 reads W2 [n, k] (B_TRANS), dx W1 / W3 [k, n]
        trans = not two_pairs
        a, b = f"tensordesc<bf16[{block_m}, {block_k}]>", (f"tensordesc<bf16[{block_n}, {block_k}]>" if trans
                                                           else f"tensordesc<bf16[{block_k}, {block_n}]>")
    else:
        trans, a, b = True, _fp8_desc(block_m), _fp8_desc(block_n)
    sig = {"a1_ptr": a, "b1_ptr": b, "a2_ptr": a, "b2_ptr": b, **PLAN, "out_ptr": "*bf16",
           **({} if bf16 else _types("a1s_ptr b1s_ptr a2s_ptr b2s_ptr", "*fp32")),
           **_types("KD ND num_tiles stride_be stride_bk stride_bn", "i32")}
    return _row_kernel(_grouped_gemm_kernel, sig, dict(TWO_PAIRS=two_pairs, TMA=True, B_TRANS=trans, WS=False,
                                                       SORTED_OUT=sorted_out, PEER_OUT=False, WAIT=False,
                                                       BLOCK_M=block_m, SUB_TILES=128 // block_m, GROUP_M=group_m, BLOCK_N=block_n,
                                                       BLOCK_K=block_k, FP8=not bf16, PERSISTENT=persistent,
                                                       ONE_LOOP=one_loop),
                       num_warps, num_stages)


def wgrad_fp8(dual: bool, block_m: int = 64, block_n: int = 128, num_warps: int = 4, num_stages: int = 3):
    """The block-FP8 weight gradient (dW2, or dW1/dW3 with `dual`) over TMA token tiles."""
    from titan_megamoe.kernels import wgrad

    sig = {"a_src": _fp8_desc(block_m), "b_src": _fp8_desc(block_n), **_types("a_scale_ptr b_scale_ptr", "*fp32"),
           **_types("offsets_ptr expert_slot_ptr", "*i32"), "c_ptr": "*bf16",
           **_types("M N stride_sa stride_sb stride_ce stride_cm stride_a stride_b", "i32")}
    if dual:
        sig.update(a2_src=_fp8_desc(block_m), a2_scale_ptr="*fp32", c2_ptr="*bf16")
    const = dict(DUAL=dual, EVEN_M=True, EVEN_N=True, OUT_BF16=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
                 BLOCK_E=128, TMA=True)
    return _row_kernel(wgrad._expert_wgrad_fp8_kernel, sig, const, num_warps, num_stages)


def gluon_rows(block_m: int = 64, block_n: int = 128, num_warps: int = 4, stages: int = 4, sorted_out: bool = False):
    """The Gluon block-FP8 row GEMM (`fp8_rows_gluon`): GEMM2 and dx are one binary (dx's second pair is
    runtime arguments and K blocks), dgrad's q the `sorted_out` one."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from titan_megamoe.kernels.fp8_rows_gluon import _fp8_rows_kernel

    sig = {**_gluon_fp8_descs(block_m, block_n), **_types("a1s_ptr b1s_ptr a2s_ptr b2s_ptr", "*fp32"), **PLAN,
           "out_ptr": "*bf16", **_types("N KD ND NK1", "i32")}
    aligned = {n for n, t in sig.items() if t.startswith("*") or t == "i32"}
    return compile_sm90(_fp8_rows_kernel, sig, dict(SORTED_OUT=sorted_out, BLOCK_M=block_m, SUB_TILES=128 // block_m,
                                                    BLOCK_N=block_n, STAGES=stages, num_warps=num_warps),
                        aligned, num_warps, 1, source=GluonASTSource)


def gluon_rows_ws(block_n: int = 128, stages: int = 4, sorted_out: bool = False, staged_scales: bool | None = None,
                  group_m: int = 1):
    """The persistent warp-specialised Gluon block-FP8 row GEMM (`fp8_rows_ws_gluon`), as it launches."""
    from titan_megamoe.kernels import fp8_rows_ws_gluon as ws

    staged = ws.STAGED_SCALES if staged_scales is None else staged_scales
    sig = {**_gluon_fp8_descs(ws.HALF_M.value, block_n), **_types("a1s_ptr b1s_ptr a2s_ptr b2s_ptr", "*fp32"), **PLAN,
           "out_ptr": "*bf16", **_types("N KD ND NK1 num_items", "i32")}
    return _compile_ws(ws._fp8_rows_ws_kernel, sig, stages, ws.consumer_regs(block_n),
                       ws.STAGING_PRODUCER_REGS if staged else ws.PRODUCER_REGS, SORTED_OUT=sorted_out,
                       BLOCK_N=block_n, STAGED_SCALES=staged, GROUP_M=group_m)


def gluon_gemm1_ws(stages: int = 4, block_n: int = 64, group_m: int = 1):
    """The persistent warp-specialised Gluon block-FP8 GEMM1 (`fp8_gemm1_ws_gluon`), as it launches."""
    from titan_megamoe.kernels import fp8_gemm1_ws_gluon as g1
    from titan_megamoe.kernels import fp8_rows_ws_gluon as ws

    descs = _gluon_fp8_descs(ws.HALF_M.value, block_n)
    sig = {"x_desc": descs["a1_desc"], "w1_desc": descs["b1_desc"], "w3_desc": descs["b1_desc"],
           **_types("xs_ptr w1s_ptr w3s_ptr", "*fp32"), **_types("tile_expert_ptr tile_row_ptr offsets_ptr", "*i32"),
           **_types("g_ptr u_ptr", "*bf16"), "h_ptr": "*fp8e4nv",
           "hs_ptr": "*fp32", **_types("N D H num_items", "i32")}
    return _compile_ws(g1._fp8_gemm1_ws_kernel, sig, stages, BLOCK_N=block_n, GROUP_M=group_m)


def gluon_wgrad_ws(stages: int = 4, out: str = "bf16", dual: bool = False, tma_store: bool = True):
    """The persistent warp-specialised Gluon block-FP8 weight gradient (`fp8_wgrad_ws_gluon`), as it launches."""
    from triton.experimental import gluon  # noqa: F401  (gl below)
    from triton.experimental.gluon import language as gl

    from titan_megamoe.kernels import fp8_rows_ws_gluon as ws
    from titan_megamoe.kernels import fp8_wgrad_ws_gluon as wg

    descs = _gluon_fp8_descs(ws.HALF_M.value, 128)
    sig = {"a_desc": descs["a1_desc"], "a2_desc": descs["a1_desc"], "b_desc": descs["b1_desc"],
           **_types("a_scale_ptr a2_scale_ptr b_scale_ptr", "*fp32"),
           **_types("expert_slot_ptr first_tile_ptr offsets_ptr", "*i32"), **_types("c_ptr c2_ptr", f"*{out}"),
           **_types("num_items tiles_m tiles_n M N stride_sa stride_sb", "i32")}
    if tma_store:
        gl_out = {"bf16": gl.bfloat16, "fp32": gl.float32}[out]
        layout = gl.NVMMASharedLayout.get_default_for([ws.HALF_M.value, 128], gl_out)
        sig.update(_types("c_desc c2_desc", f"tensordesc<{out}[{ws.HALF_M.value}, 128],{layout!r}>"))
    return _compile_ws(wg._fp8_wgrad_ws_kernel, sig, stages, wg.consumer_regs(dual), ws.STAGING_PRODUCER_REGS,
                       DUAL=dual, TMA_STORE=tma_store)


def _compile_ws(fn, sig: dict, stages: int, consumer_regs: int | None = None, producer_regs: int | None = None,
                **constexprs) -> dict:
    """A persistent warp-specialised Gluon kernel compiled with the constexprs and launch options its
    launcher passes (`fp8_rows_ws_gluon.ws_options`); pointers and i32 arguments 16-byte divisible."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from titan_megamoe.kernels.fp8_rows_ws_gluon import CONSUMER_REGS, PRODUCER_REGS, ws_options

    opts = ws_options(stages, consumer_regs or CONSUMER_REGS, producer_regs or PRODUCER_REGS)
    num_warps, maxnreg = opts.pop("num_warps"), opts.pop("maxnreg")
    aligned = {n for n, t in sig.items() if t.startswith("*") or t == "i32"}
    return compile_sm90(fn, sig, {**constexprs, **opts}, aligned, num_warps, 1, source=GluonASTSource,
                        maxnreg=maxnreg)


def _gluon_fp8_descs(block_m: int, block_n: int) -> dict:
    """The four e4m3 operand descriptors of the Gluon row GEMMs (A tiles block_m x 128, B block_n x 128)."""
    from triton.experimental.gluon import language as gl

    def desc(rows):
        return f"tensordesc<fp8e4nv[{rows}, 128],{gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)!r}>"

    return {"a1_desc": desc(block_m), "b1_desc": desc(block_n), "a2_desc": desc(block_m), "b2_desc": desc(block_n)}


def gluon_gemm1(block_m: int = 64, num_warps: int = 4, stages: int = 4):
    """The Gluon block-FP8 GEMM1 (`fp8_gemm1_gluon`): gate and up with the promotion overlapped, SwiGLU, h in e4m3."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from titan_megamoe.kernels.fp8_gemm1_gluon import _fp8_gemm1_kernel

    def desc(rows):
        return f"tensordesc<fp8e4nv[{rows}, 128],{gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)!r}>"

    sig = {"x_desc": desc(block_m), "w1_desc": desc(64), "w3_desc": desc(64),
           **_types("xs_ptr w1s_ptr w3s_ptr hs_ptr", "*fp32"),
           **_types("tile_expert_ptr tile_row_ptr offsets_ptr", "*i32"),
           **_types("g_ptr u_ptr", "*bf16"), "h_ptr": "*fp8e4nv", **_types("N D H", "i32")}
    aligned = {n for n, t in sig.items() if t.startswith("*") or t == "i32"}
    return compile_sm90(_fp8_gemm1_kernel, sig, dict(BLOCK_M=block_m, SUB_TILES=128 // block_m, STAGES=stages,
                                                     num_warps=num_warps), aligned, num_warps, 1, source=GluonASTSource)


def gluon_weight_quant(dtype: str = "bf16", num_warps: int = 8, exact_cast: bool = False):
    """The Gluon weight quantizer (`quantize_gluon`), W and W^T in one pass, a contiguous weight."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from titan_megamoe.kernels.quantize_gluon import _weight_pair_kernel

    sig = {"w_ptr": f"*{dtype}", **_types("data_ptr data_t_ptr", "*fp8e4nv"),
           **_types("scale_ptr scale_t_ptr", "*fp32"),
           **_types("R C stride_e stride_r", "i32")}
    aligned = set(sig)
    return compile_sm90(_weight_pair_kernel, sig, dict(stride_c=1, WRITE_W=True, EXACT_CAST=exact_cast,
                                                       num_warps=num_warps), aligned, num_warps, 1,
                        source=GluonASTSource)


def gluon_token_tiles(num_warps: int = 4, exact_cast: bool = False):
    """The Gluon token-tile quantizer (`quantize_gluon`): x's or dout's tiles (gathered)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from titan_megamoe.kernels.quantize_gluon import _token_tiles_kernel

    sig = {"src_ptr": "*bf16", **PLAN, "data_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
           **_types("C num_tiles rows_per_token stride_r", "i32")}
    return compile_sm90(_token_tiles_kernel, sig, dict(stride_c=1, GATHER=True, EXACT_CAST=exact_cast,
                                                       num_warps=num_warps),
                        set(sig), num_warps, 1, source=GluonASTSource)


def gluon_dswiglu_fp8(num_warps: int = 8, exact_cast: bool = False):
    """The one-kernel Gluon block-FP8 dSwiGLU (`dswiglu_fp8_gluon`)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from titan_megamoe.kernels.dswiglu_fp8_gluon import _dswiglu_fp8_kernel

    sig = {**_types("q_ptr g_ptr u_ptr", "*bf16"), "scores_ptr": "*fp32", **PLAN,
           **{n: ("*fp8e4nv" if i % 2 == 0 else "*fp32") for i, n in enumerate(
               "dg_ptr dg_s_ptr du_ptr du_s_ptr dgt_ptr dgt_s_ptr dut_ptr dut_s_ptr hst_ptr hst_s_ptr".split())},
           "ds_part_ptr": "*fp32", **_types("H P", "i32")}
    return compile_sm90(_dswiglu_fp8_kernel, sig, dict(EXACT_CAST=exact_cast, num_warps=num_warps), set(sig),
                        num_warps, 1, source=GluonASTSource)


def gluon_dswiglu_fp8_persistent(num_warps: int = 16, exact_cast: bool = False):
    """The persistent Gluon block-FP8 dSwiGLU (`dswiglu_fp8_gluon`): q, g, u through TMA, two stages."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from titan_megamoe.kernels.dswiglu_fp8_gluon import _dswiglu_fp8_persistent_kernel

    desc = f"tensordesc<bf16[128, 128],{gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16)!r}>"
    sig = {**{n: desc for n in ("q_desc", "g_desc", "u_desc")}, "scores_ptr": "*fp32", **PLAN,
           **{n: ("*fp8e4nv" if i % 2 == 0 else "*fp32") for i, n in enumerate(
               "dg_ptr dg_s_ptr du_ptr du_s_ptr dgt_ptr dgt_s_ptr dut_ptr dut_s_ptr hst_ptr hst_s_ptr".split())},
           "ds_part_ptr": "*fp32", **_types("H P num_tiles", "i32")}
    aligned = {n for n, t in sig.items() if t.startswith("*") or t == "i32"}
    return compile_sm90(_dswiglu_fp8_persistent_kernel, sig, dict(EXACT_CAST=exact_cast, num_warps=num_warps),
                        aligned, num_warps, 1, source=GluonASTSource)


def dswiglu_fp8(num_warps: int):
    """Block-FP8 dgrad's elementwise half: dSwiGLU and the quantization of dg, du (rows, token tiles), s*h."""
    from titan_megamoe.kernels.dgrad_swiglu import _dswiglu_fp8_kernel

    sig = {**_types("q_ptr g_ptr u_ptr", "*bf16"), "scores_ptr": "*fp32", **PLAN,
           **{n: ("*fp8e4nv" if i % 2 == 0 else "*fp32") for i, n in enumerate(
               "dg_ptr dg_s_ptr du_ptr du_s_ptr dgt_ptr dgt_s_ptr dut_ptr dut_s_ptr hst_ptr hst_s_ptr".split())},
           "ds_part_ptr": "*fp32", **_types("H P", "i32")}
    aligned = {n for n, t in sig.items() if t.startswith("*") or t == "i32"}
    return compile_sm90(_dswiglu_fp8_kernel, sig, dict(BLOCK=128, INTERPRET=False), aligned, num_warps, 1)


def _launch_shape(c) -> dict:
    """A tile config's rows, warps, stages and row grouping as the compile helpers above take them."""
    return dict(block_m=c.block_m, num_warps=c.num_warps, num_stages=c.num_stages, group_m=c.group_m)


def shipped_fp8_rows(dim: int, hidden: int) -> dict:
    """The FP8 row kernels with the tile configs the table ships for (dim, hidden), as they launch (TMA)."""
    from titan_megamoe.kernels.configs import tile_config

    def cfg(kernel):
        c = tile_config(kernel, dim, hidden, "fp8")
        assert c.tma, f"{kernel}: the shipped FP8 config reads through TMA, which these signatures assume"
        return dict(_launch_shape(c), **({"persistent": c.persistent > 0} if kernel != "gemm1_swiglu" else {})), c

    out = {}
    # where the table picks the persistent warp-specialised Gluon kernels (gluon + warp_specialize), those
    kw, c = cfg("gemm1_swiglu")
    out["gemm1"] = dict(gluon_gemm1_ws(c.num_stages, c.block_n, c.group_m) if c.gluon else gemm1(c.block_n, **kw),
                        block_n=c.block_n)
    kw, c = cfg("gemm2")
    out["gemm2"] = dict(gluon_rows_ws(c.block_n, c.num_stages, group_m=c.group_m) if c.gluon
                        else grouped_gemm(c.block_n, False, **kw),
                        block_n=c.block_n)
    kw, c = cfg("dx")
    out["dx"] = dict(gluon_rows_ws(c.block_n, c.num_stages, group_m=c.group_m) if c.gluon
                     else grouped_gemm(c.block_n, True, one_loop=c.pairs_in_one_loop, **kw), block_n=c.block_n)
    kw, c = cfg("dgrad_swiglu")
    out["dgrad q"] = dict(gluon_rows_ws(c.block_n, c.num_stages, sorted_out=True, group_m=c.group_m) if c.gluon
                          else grouped_gemm(c.block_n, False, sorted_out=True, **kw), block_n=c.block_n)
    return out


def shipped_bf16_rows(dim: int, hidden: int) -> dict:
    """The bf16 GEMMs of GEMM1, GEMM2, dx and dgrad with the tile configs the table ships for (dim, hidden), as
    the launchers call them on a whole-tensor launch (the weight gradients: tests/test_kernel_wgrad.py)."""
    from titan_megamoe.kernels.configs import tile_config

    def cfg(kernel):
        c = tile_config(kernel, dim, hidden, "bf16")
        assert not c.gluon, f"{kernel}: a bf16 Gluon entry, which these signatures do not cover"
        return c, _launch_shape(c)

    out = {}
    c, kw = cfg("gemm1_swiglu")  # x gathered by pointer (the sorted-rows read is FP8's), W1/W3 as the table says
    out["gemm1"] = gemm1(c.block_n, w_tma=c.tma, a_tma=False, bf16=True, block_k=c.block_k, **kw)
    for name, two_pairs in (("gemm2", False), ("dx", True)):
        c, kw = cfg(name)
        assert c.tma, f"{name}: the shipped bf16 config reads through TMA, which these signatures assume"
        out[name] = grouped_gemm(c.block_n, two_pairs, bf16=True, block_k=c.block_k, persistent=c.persistent > 0,
                                 one_loop=c.pairs_in_one_loop, **kw)
    c, kw = cfg("dgrad_swiglu")
    if c.split and c.tma:  # dout copied into sorted order, then q by the grouped GEMM with sorted stores
        out["dgrad"] = grouped_gemm(c.block_n, False, sorted_out=True, bf16=True, block_k=c.block_k,
                                    persistent=c.persistent > 0, **kw)
    else:
        out["dgrad"] = dgrad_bf16(c.block_n, c.block_k, c.weight_tma and hidden > c.block_n, c.split, **kw)
    return out


JOBS = {  # Triton FP8 row kernels (the tiles off Hopper: kernels/configs.py) and bf16 ones
    "gemm1 128 rows 8 warps": lambda: gemm1(64),
    "gemm1 64 rows 4 warps": lambda: gemm1(64, block_m=64, num_warps=4),
    "gemm2 128 rows 8 warps": lambda: grouped_gemm(128, False),
    "gemm2 64 rows 4 warps": lambda: grouped_gemm(128, False, block_m=64, num_warps=4),
    "gemm2 64 rows 4 warps persistent": lambda: grouped_gemm(128, False, block_m=64, num_warps=4, num_stages=4,
                                                             persistent=True),
    "bf16 gemm2 128x256x64 3 stages": lambda: grouped_gemm(256, False, bf16=True, block_k=64),
    "bf16 gemm2 128x256x64 3 stages persistent": lambda: grouped_gemm(256, False, bf16=True, block_k=64, persistent=True),
    "bf16 dx 128x256x64 3 stages persistent": lambda: grouped_gemm(256, True, bf16=True, block_k=64, persistent=True),
    "bf16 dx one loop 128x128x64 3 stages": lambda: grouped_gemm(128, True, bf16=True, block_k=64, one_loop=True),
    "bf16 dx one loop 128x128x64 3 stages persistent": lambda: grouped_gemm(128, True, bf16=True, block_k=64,
                                                                           one_loop=True, persistent=True),
    "bf16 dx one loop 128x128x32 4 stages persistent": lambda: grouped_gemm(128, True, bf16=True, block_k=32,
                                                                           num_stages=4, one_loop=True,
                                                                           persistent=True),
    "dx 64 rows 4 warps 4 stages": lambda: grouped_gemm(128, True, block_m=64, num_warps=4, num_stages=4),
    "dx one loop 64 rows 4 warps": lambda: grouped_gemm(128, True, block_m=64, num_warps=4, one_loop=True),
    "dx one loop 64 rows 4 warps 2 stages persistent": lambda: grouped_gemm(128, True, block_m=64, num_warps=4,
                                                                           num_stages=2, one_loop=True,
                                                                           persistent=True),
    "dx one loop 128 rows 8 warps persistent": lambda: grouped_gemm(128, True, one_loop=True, persistent=True),
    "wgrad fp8 dW2 64x128": lambda: wgrad_fp8(False),
    "wgrad fp8 dW1/dW3 64x128": lambda: wgrad_fp8(True),
    "dx 128 rows 8 warps": lambda: grouped_gemm(128, True),
    "dx 64 rows 4 warps": lambda: grouped_gemm(128, True, block_m=64, num_warps=4),
    "dgrad q 128 rows 8 warps": lambda: grouped_gemm(128, False, sorted_out=True),
    "dgrad q 64 rows 4 warps": lambda: grouped_gemm(128, False, block_m=64, num_warps=4, sorted_out=True),
    "gluon gemm2/dx 64 rows 4 warps": lambda: gluon_rows(),
    "gluon dgrad q 64 rows 4 warps": lambda: gluon_rows(sorted_out=True),
    "gluon gemm2/dx 128 rows 8 warps": lambda: gluon_rows(block_m=128, num_warps=8),
    "gluon gemm2/dx persistent, warp-specialised, 4 stages": lambda: gluon_rows_ws(),
    "gluon dgrad q persistent, warp-specialised, 4 stages": lambda: gluon_rows_ws(sorted_out=True),
    "gluon gemm1 persistent, warp-specialised, 4 stages": lambda: gluon_gemm1_ws(),
    "gluon wgrad persistent, warp-specialised, 4 stages": lambda: gluon_wgrad_ws(),
    "gluon gemm1 64 rows 4 warps": lambda: gluon_gemm1(),
    "gluon gemm1 128 rows 8 warps 3 stages": lambda: gluon_gemm1(128, 8, 3),
    "gluon weight quant bf16 8 warps": lambda: gluon_weight_quant(),
    "gluon weight quant fp32 4 warps exact": lambda: gluon_weight_quant("fp32", 4, True),
    "gluon token tiles 4 warps": lambda: gluon_token_tiles(),
    "gluon token tiles 4 warps exact": lambda: gluon_token_tiles(4, True),
    "gluon dswiglu fp8 8 warps": lambda: gluon_dswiglu_fp8(8),
    "gluon dswiglu fp8 16 warps exact": lambda: gluon_dswiglu_fp8(16, True),
    "gluon dswiglu fp8 4 warps": lambda: gluon_dswiglu_fp8(4),
    "gluon dswiglu fp8 16 warps persistent": lambda: gluon_dswiglu_fp8_persistent(16),
    "gluon dswiglu fp8 8 warps persistent": lambda: gluon_dswiglu_fp8_persistent(8),
    "dswiglu fp8 8 warps": lambda: dswiglu_fp8(8),
    "dswiglu fp8 16 warps": lambda: dswiglu_fp8(16),
}

if __name__ == "__main__":
    for name in sys.argv[1:] or JOBS:
        try:
            r = JOBS[name]()
            print(f"{name:32s} QGMMA {r['qgmma']} HGMMA {r['hgmma']} {r['usage'][:40]} smem {r['smem']} "
                  f"wgmma waits {r['wgmma_waits']} MMA loops {r['mma_loops']} e4m3 casts {r['e4m3_casts']} "
                  f"stores {r['global_stores']}", flush=True)
        except Exception as e:  # one kernel's compile error must not hide the others' rows
            print(f"{name:32s} ERROR {str(e)[:300]}", flush=True)
