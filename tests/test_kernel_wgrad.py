"""Expert weight-gradient kernels (titan_megamoe/kernels/wgrad.py) against a float64 oracle.

On CPU the kernels run in Triton's interpreter (tests/conftest.py chooses it before triton is imported);
on a GPU host the same cases run compiled on CUDA. Tolerance, the FlashAttention rule:
|kernel - ref64|.max() <= 2 * |torch_bf16 - ref64|.max() + 1e-5, where torch_bf16 does the same GEMMs in
bf16 per expert. Outputs are poisoned with NaN (TITAN_MEGAMOE_POISON=1), so a tile the kernel fails to
write (an empty expert, a ragged edge) fails the test.
"""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe_cases import sm90_compile_results, stack_bytes
from titan_megamoe import oracle
from titan_megamoe.kernels import wgrad
from titan_megamoe.kernels.common import INTERPRET
from titan_megamoe.kernels.configs import TileConfig, override_tile_config


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter converts a 1-element array to int for `range(lo, hi)` with loaded bounds,
    which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream). Apply the upstream fix; it is
    the same conversion on older numpy, so it is applied whatever numpy is installed."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_megamoe_index_fix", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._megamoe_index_fix = True


if INTERPRET:
    _patch_interpreter_for_numpy_2_4()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU or Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")


# tiny tiles for the interpreter; the variants cover ragged edges and the TMA operand
SMALL = TileConfig(16, 32, 16, 4, 1)
CONFIGS = {
    "base": SMALL,
    "wide": TileConfig(32, 32, 32, 4, 1),
    "tma": TileConfig(16, 32, 16, 4, 1, tma=True),  # the sorted operand through a TMA descriptor
    # the gathered operand copied into sorted order, both through TMA (a partial last block per expert)
    "sorted_copy": TileConfig(16, 32, 16, 4, 1, tma=True, sorted_copy=True),
    "sorted_copy_ws": TileConfig(16, 32, 16, 4, 1, tma=True, sorted_copy=True, warp_specialize=True),
}

# name: (T, K, E, D, H)
CASES = {
    "random": (40, 2, 4, 48, 32),
    "skewed": (32, 2, 6, 32, 48),  # every token's first choice is expert 3
    "empty": (20, 2, 6, 32, 32),  # experts 0, 2 and 5 get no rows
    "all_one": (12, 2, 4, 32, 32),  # both slots of every token on expert 1: all N rows on one expert
    "k1": (24, 1, 4, 32, 32),
    "t1": (1, 2, 4, 32, 32),
}


def _topk_ids(case: str, T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(T, E, generator=gen)
    if case == "skewed":
        logits[:, 3] += 100.0
    if case == "empty":
        logits[:, [0, 2, 5]] = float("-inf")
    ids = logits.topk(K, dim=1).indices
    if case == "all_one":
        ids = torch.full_like(ids, 1)
    return ids


def _problem(case: str, seed: int = 0):
    """Realistic operands from a small float32 MoE forward/backward, in bf16 and expert-sorted order."""
    T, K, E, D, H = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    ids_TK = _topk_ids(case, T, K, E, gen)
    plan = oracle.routing_plan(ids_TK, E, block_m=16)
    oracle.check_routing_invariants(plan, ids_TK)
    tok = plan.order_N.long() // K
    experts = ids_TK.reshape(-1)[plan.order_N.long()]
    x = torch.randn(T, D, generator=gen)
    w1, w3 = (0.02 * torch.randn(E, H, D, generator=gen) for _ in range(2))
    w2 = 0.02 * torch.randn(E, D, H, generator=gen)
    scores = torch.softmax(torch.randn(T, K, generator=gen), dim=1).reshape(-1)[plan.order_N.long()]
    dout = torch.randn(T, D, generator=gen)
    g = torch.einsum("nd,nhd->nh", x[tok], w1[experts])
    u = torch.einsum("nd,nhd->nh", x[tok], w3[experts])
    h = F.silu(g) * u
    dh = torch.einsum("nd,ndh->nh", scores[:, None] * dout[tok], w2[experts])
    sig = torch.sigmoid(g)
    dg = dh * u * sig * (1 + g * (1 - sig))
    du = dh * F.silu(g)
    bf = lambda t: t.to(torch.bfloat16).to(DEVICE).contiguous()  # noqa: E731
    # hs = s*h rounded once to bf16, as the dgrad epilogue writes dW2's operand
    return dict(x=bf(x), dout=bf(dout), hs=bf(scores[:, None] * h), dg=bf(dg), du=bf(du),
                plan=oracle.RoutingPlan.from_packed(plan.packed.to(DEVICE), plan.layout), E=E, D=D, H=H)


def _assert_close(name, out, ref64, ref_bf16):
    assert not torch.isnan(out).any(), f"{name}: NaN left in the output (a tile was not written)"
    err = (out.double().cpu() - ref64.cpu()).abs().max().item()
    err_torch = (ref_bf16.double().cpu() - ref64.cpu()).abs().max().item()
    assert err <= 2 * err_torch + 1e-5, f"{name}: max error {err:.3e} > 2 * torch bf16 error {err_torch:.3e} + 1e-5"


def _configured(cfg):
    stack = contextlib.ExitStack()
    for kernel in ("wgrad_w2", "wgrad_w13"):
        stack.enter_context(override_tile_config(kernel, cfg))
    return stack


def _check_w2(p, out_dtype, cfg):
    with _configured(cfg):
        out = wgrad.expert_wgrad_w2(p["dout"], p["hs"], p["plan"], out_dtype)
    assert out.shape == (p["E"], p["D"], p["H"]) and out.dtype == out_dtype
    ref64 = oracle.wgrad_w2_reference(p["dout"], p["hs"], p["plan"], torch.float64)
    ref_bf16 = oracle.wgrad_w2_reference(p["dout"], p["hs"], p["plan"], torch.bfloat16)
    _assert_close("dW2", out, ref64, ref_bf16)


def _check_w13(p, out_dtype, cfg):
    with _configured(cfg):
        dw1, dw3 = wgrad.expert_wgrad_w13(p["dg"], p["du"], p["x"], p["plan"], out_dtype)
    ref1_64, ref3_64 = oracle.wgrad_w13_reference(p["dg"], p["du"], p["x"], p["plan"], torch.float64)
    ref1_bf, ref3_bf = oracle.wgrad_w13_reference(p["dg"], p["du"], p["x"], p["plan"], torch.bfloat16)
    _assert_close("dW1", dw1, ref1_64, ref1_bf)
    _assert_close("dW3", dw3, ref3_64, ref3_bf)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_wgrad_routing_cases(case, out_dtype):
    p = _problem(case)
    _check_w2(p, out_dtype, cfg=SMALL)
    _check_w13(p, out_dtype, cfg=SMALL)


@pytest.mark.parametrize(
    "case, config", [("random", "wide"), ("random", "tma"), ("skewed", "tma"), ("empty", "tma"), ("all_one", "tma"),
                     ("random", "sorted_copy"), ("empty", "sorted_copy"), ("k1", "sorted_copy"),
                     ("skewed", "sorted_copy_ws")]
)  # fmt: skip
def test_wgrad_config_variants(case, config):
    p = _problem(case, seed=1)
    _check_w2(p, torch.bfloat16, cfg=CONFIGS[config])
    _check_w2(p, torch.float32, cfg=CONFIGS[config])
    _check_w13(p, torch.float32, cfg=CONFIGS[config])


def test_wgrad_rejects_bad_inputs():
    p = _problem("random")
    plan = p["plan"]
    with pytest.raises(ValueError, match="contiguous"):
        wgrad.expert_wgrad_w2(p["dout"].t().contiguous().t(), p["hs"], plan, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        wgrad.expert_wgrad_w13(p["dg"].float(), p["du"], p["x"], plan, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        wgrad.expert_wgrad_w13(p["dg"][:, :24].contiguous(), p["du"][:, :24].contiguous(), p["x"], plan,
                               torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        wgrad.expert_wgrad_w2(p["dout"], p["hs"], plan, torch.float16)
    with pytest.raises(ValueError, match="unknown fields"):
        TileConfig.from_record({"blockm": 16})


# Runs in a fresh process: once triton is imported with TRITON_INTERPRET=1 its own library functions
# (tl.cdiv, ...) are interpreted too, so a real compile cannot happen in this one.
_SM90_COMPILE = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import compile_sm90 as compile_kernel  # the one sm_90 compile + SASS check
from titan_megamoe.kernels import wgrad
from dataclasses import replace
from titan_megamoe.kernels.configs import tile_config

def compile_sm90(kind, sorted_copy, dim=2048, hidden=768):
    # the launch the pipeline makes: dW2 over (gathered dout, sorted s*h), dW1/dW3 over (sorted dg, du,
    # gathered x); with the table's `tma` the sorted operand is a TMA descriptor. sorted_copy: the gathered
    # operand copied into sorted order, both operands TMA descriptors, the loop warp-specialised
    cfg = tile_config(f"wgrad_{kind}", dim, hidden)
    if sorted_copy:
        cfg = replace(cfg, tma=True, sorted_copy=True, warp_specialize=True)
    sorted_copy = cfg.sorted_copy
    w2 = kind == "w2"
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tma = cfg.tma
    ptrs = dict(a_ptr="*bf16", a2_ptr="*bf16", b_ptr="*bf16", order_ptr="*i32", offsets_ptr="*i32",
                expert_slot_ptr="*i32", c_ptr="*bf16", c2_ptr="*bf16")
    descs = {}
    if tma and (w2 or sorted_copy):
        descs["b_ptr"] = f"tensordesc<bf16[{bk}, {bn}]>"
    if tma and (not w2 or sorted_copy):
        descs.update(a_ptr=f"tensordesc<bf16[{bk}, {bm}]>", a2_ptr=f"tensordesc<bf16[{bk}, {bm}]>")
    ints = dict.fromkeys(["M", "N", "stride_a", "stride_b", "stride_ce", "stride_cm"], "i32")
    constexprs = dict(
        TOP_K=8, A_GATHER=w2 and not sorted_copy, B_GATHER=not w2 and not sorted_copy, DUAL=not w2, EVEN_M=True,
        EVEN_N=True, OUT_BF16=True, SORTED_TMA=tma, WS=cfg.warp_specialize, INTERPRET=False, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk)
    ptrs.update(descs)
    aligned = (set(ptrs) - set(descs)) | set(ints)
    return compile_kernel(wgrad._expert_wgrad_kernel, {**ptrs, **ints}, constexprs, aligned, cfg.num_warps,
                        cfg.num_stages)

out = {f"{kind}{'_sorted_copy' if c else ''}": compile_sm90(kind, c) for kind in ("w2", "w13") for c in (False, True)}
# Qwen3-235B-A22B's shipped configs as they are (both read sorted copies through TMA there)
out.update({f"{kind}_235b": compile_sm90(kind, False, 4096, 1536) for kind in ("w2", "w13")})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sm90_compiles():
    return sm90_compile_results(_SM90_COMPILE, timeout=300)


@pytest.mark.parametrize("kind", ["w2", "w13", "w2_sorted_copy", "w13_sorted_copy", "w2_235b", "w13_235b"])
def test_default_config_compiles_to_wgmma_on_sm90(sm90_compiles, kind):
    """Compile the shipped config for sm_90 on the CPU (no GPU needed; Triton bundles ptxas and cuobjdump) at
    Qwen3-30B-A3B's shape, and there the same tiles with both operands in sorted order through TMA,
    warp-specialised, and the shipped configs at Qwen3-235B-A22B's: the GEMM must lower to wgmma (HGMMA in
    the SASS) and nothing may spill to the stack."""
    res = sm90_compiles[kind]
    print(kind, res)
    assert res["wgmma_ir"], "the GEMM did not lower to a warp-group (wgmma) dot"
    assert res["hgmma"] > 0, "no HGMMA instruction in the SASS"
    assert stack_bytes(res["usage"]) == 0, f"register spills: {res['usage']}"
