"""Block-FP8 expert weight gradients (kernels/wgrad.py: expert_wgrad_w2_fp8, expert_wgrad_w13_fp8).

Operands are built as the pipeline will build them: expert-sorted bf16 rows quantized into the token-tile
layout (`quant.quantize_token_tiles`) of a plan from `build_routing_plan(..., 128)`. References:
- ref64: float64 products of the dequantized token tiles, per expert over its tiles;
- the oracle's math (`oracle._fp8_backward`): `quant.quantize_token_blocks` per expert segment, dequantized,
  in float64 (must equal ref64: the two layouts hold the same values) and in fp32 (the emulation itself).
A block-scaled GEMM of power-of-two scales adds no rounding beyond its sums, so the kernel must match
ref64 elementwise to TOL times the magnitude |A| |B|^T of the same sum (zero where the magnitude is zero:
empty experts, all-zero rows), plus, on the GPU, MMA_TOL times the largest products the tiles can hold
(Hopper's FP8 MMA sums a tile with reduced precision), plus bf16's half ulp when it stores bf16. Outputs
are NaN-poisoned (TITAN_MEGAMOE_POISON=1), so an element the kernel does not write fails.

On CPU the kernels run in Triton's interpreter (tests/conftest.py) with small shapes; on a GPU host the same
cases run compiled, plus a Qwen3-30B-A3B-sized layer.
"""

import contextlib
import math

from dataclasses import replace

import pytest
import torch

from test_kernel_wgrad import _patch_interpreter_for_numpy_2_4
from titan_megamoe import quant
from titan_megamoe.kernels import wgrad
from titan_megamoe.kernels.common import INTERPRET
from titan_megamoe.kernels.configs import TileConfig, override_tile_config
from titan_megamoe.kernels.routing_meta import build_routing_plan
from titan_megamoe.precision import BlockScaled

if INTERPRET:
    _patch_interpreter_for_numpy_2_4()
CUDA = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not CUDA,
                                reason="needs a CUDA GPU or Triton's interpreter (TRITON_INTERPRET=1)")

# fp32 summation accuracy relative to sum |a b| (the interpreter sums each 128-token tile in numpy's fp32,
# the kernel sums the tiles in fp32). On the GPU each tile's sum is Hopper's FP8 MMA, which adds with
# reduced precision (products aligned to the largest exponent and truncated; DeepSeek-V3 measured ~14
# bits): its error follows the tile's largest product, bounded by peak = amax_a(row, tile) amax_b(col, tile).
# 128 products truncated at ~2^-13 of it: at most ~2^-6 peak. Measured on an H200 (Triton 3.6), these cases:
# error / peak up to 3.5e-3, error / sum |a b| up to 3.4e-3 with outliers (3e-4 without), 20-100x the fp32
# emulation's: on the GPU the kernel matches the emulation to the MMA's accuracy, not to fp32's
TOL = 1e-5
MMA_TOL = 0.0 if INTERPRET else 2.0**-6
BF16_HALF_ULP = 2.0**-8


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")


# name: (routing, E, D, H, values). routing: a list of per-expert row counts (1-D ids, contiguous rows) or
# (T, K, kind) for top-k ids. The interpreter's FP8 tiles are 32 x 32 (configs._INTERPRETER_FP8): D = 48,
# H = 80 leave ragged M and N edges; on the GPU (128 x 128 tiles) H = 192 and D = 320 do
CASES = {
    "segments": ([1, 127, 128, 129, 300, 0], 6, 48, 80, "randn"),
    "empty": ((150, 2, "empty"), 6, 32, 64, "randn"),
    "one_hot": ((160, 2, "one_hot"), 4, 64, 32, "randn"),
    "skewed": ((200, 2, "skewed"), 6, 32, 48, "randn"),
    "k1": ((260, 1, "random"), 4, 48, 32, "randn"),
    "outliers": ([129, 300, 60], 3, 32, 64, "outliers"),
    "zero_rows": ([130, 0, 200, 90], 4, 64, 32, "zero_rows"),
    "d128_h256": ([200, 57, 300], 3, 128, 256, "randn"),
    "d384_h256": ([129, 140], 2, 384, 256, "randn"),
}
if not INTERPRET:
    CASES["gpu_ragged"] = ([1, 127, 128, 129, 300, 0, 1000], 7, 320, 192, "randn")
    CASES["gpu_d2048_h768"] = ([64 * i for i in range(32)], 32, 2048, 768, "outliers")


def _expert_ids(routing, E, gen):
    if isinstance(routing, list):
        ids = torch.repeat_interleave(torch.arange(E), torch.tensor(routing))
        return ids[torch.randperm(ids.numel(), generator=gen)]
    T, K, kind = routing
    logits = torch.randn(T, E, generator=gen)
    if kind == "skewed":
        logits[:, 3] += 100.0
    if kind == "empty":
        logits[:, [0, 2, 5]] = float("-inf")
    ids = logits.topk(K, dim=1).indices
    return torch.full_like(ids, 1) if kind == "one_hot" else ids


def _rows(n, c, values, gen, counts):
    x = torch.randn(n, c, generator=gen)
    if values == "outliers":  # 0.2% of the entries 1e4 times the median magnitude
        x = torch.where(torch.rand(n, c, generator=gen) < 2e-3, 1e4 * x.abs().median() * x.sign(), x)
    if values == "zero_rows":  # a fifth of the rows, and every row of expert 0
        x[torch.rand(n, generator=gen) < 0.2] = 0.0
        x[: counts[0]] = 0.0
    return x.to(torch.bfloat16).to(DEVICE)


def _problem(name, seed=0):
    routing, E, D, H, values = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    plan = build_routing_plan(_expert_ids(routing, E, gen).to(DEVICE), E, 128)
    counts = (plan.offsets_E1[1:] - plan.offsets_E1[:-1]).tolist()
    n = plan.num_rows
    rows = dict(dout=_rows(n, D, values, gen, counts), hs=_rows(n, H, values, gen, counts),
                dg=_rows(n, H, values, gen, counts), du=_rows(n, H, values, gen, counts),
                x=_rows(n, D, values, gen, counts))
    tiles = {k: quant.quantize_token_tiles(v, plan) for k, v in rows.items()}
    return dict(plan=plan, rows=rows, tiles=tiles, E=E, D=D, H=H)


def _expert_tiles(plan):
    """(first tile, tiles, first row, end row) per expert (host read)."""
    off, first, out = plan.offsets_E1.tolist(), 0, []
    for lo, hi in zip(off[:-1], off[1:]):
        n = -(-(hi - lo) // 128)
        out.append((first, n, lo, hi))
        first += n
    return out


def _ref_tiles(qa, qb, plan):
    """(ref64, mag, peak) over each expert's dequantized token tiles, float64: A_e B_e^T, |A_e| |B_e|^T and
    sum over its tiles t of amax_a(row, t) amax_b(col, t) (the largest product tile t can hold)."""
    a, b = quant.dequantize(qa).double(), quant.dequantize(qb).double()
    amax_a, amax_b = (x.abs().unflatten(1, (-1, 128)).amax(dim=2) for x in (a, b))  # [rows, tiles]
    ref = a.new_zeros((plan.layout.num_experts, a.shape[0], b.shape[0]))
    mag, peak = torch.zeros_like(ref), torch.zeros_like(ref)
    for e, (t0, n, _, _) in enumerate(_expert_tiles(plan)):
        cols = slice(128 * t0, 128 * (t0 + n))
        ref[e] = a[:, cols] @ b[:, cols].T
        mag[e] = a[:, cols].abs() @ b[:, cols].abs().T
        peak[e] = amax_a[:, t0 : t0 + n] @ amax_b[:, t0 : t0 + n].T
    return ref, mag, peak


def _ref_segments(a_rows, b_rows, plan, dtype):
    """The oracle's math: token blocks (128 x 1) of each expert segment, dequantized, A^T B in dtype."""
    ref = torch.zeros((plan.layout.num_experts, a_rows.shape[1], b_rows.shape[1]), dtype=dtype, device=a_rows.device)
    for e, (_, _, lo, hi) in enumerate(_expert_tiles(plan)):
        if hi > lo:
            a, b = (quant.dequantize(quant.quantize_token_blocks(r[lo:hi])).to(dtype) for r in (a_rows, b_rows))
            ref[e] = a.T @ b
    return ref


def _excess(out, ref64, mag, peak, tol=TOL, mma_tol=MMA_TOL):
    """max over elements of |out - ref64| / bound: <= 1 passes (bound 0 demands exact equality)."""
    err = (out.double() - ref64).abs()
    bound = tol * mag + mma_tol * peak + (BF16_HALF_ULP * ref64.abs() if out.dtype == torch.bfloat16 else 0.0)
    over = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.where(err > 0, math.inf, 0.0))
    return over.max().item()


def _check(name, out, qa, qb, a_rows, b_rows, plan):
    assert not torch.isnan(out).any(), f"{name}: NaN left in the output (an element was not written)"
    ref64, mag, peak = _ref_tiles(qa, qb, plan)
    seg64 = _ref_segments(a_rows, b_rows, plan, torch.float64)
    assert ((ref64 - seg64).abs() <= 1e-12 * mag).all(), f"{name}: token tiles and token blocks disagree"
    excess = _excess(out, ref64, mag, peak)
    rel = _relative_errors(out, ref64, mag, peak)
    assert excess <= 1.0, f"{name}: error up to {excess:.2f}x the bound (max |err| / |A||B|^T, / peak: {rel})"
    emulation = _ref_segments(a_rows, b_rows, plan, torch.float32)  # oracle._fp8_backward's fp32 GEMM
    assert _excess(out, emulation.double(), mag, peak, 2 * TOL) <= 1.0, f"{name}: differs from the fp32 emulation"
    return rel


def _relative_errors(out, ref64, mag, peak) -> str:
    err = (out.double() - ref64).abs()
    return " ".join(f"{(err / m.clamp_min(1e-300)).max().item():.2e}" for m in (mag, peak))


@contextlib.contextmanager
def _configured(cfg):
    with contextlib.ExitStack() as stack:
        if cfg is not None:
            for kernel in ("wgrad_w2", "wgrad_w13"):
                stack.enter_context(override_tile_config(kernel, cfg))
        yield


def _run_w2(p, out_dtype, cfg=None):
    t = p["tiles"]
    with _configured(cfg):
        dw2 = wgrad.expert_wgrad_w2_fp8(t["dout"], t["hs"], p["plan"], out_dtype)
    assert dw2.shape == (p["E"], p["D"], p["H"]) and dw2.dtype == out_dtype
    return _check("dW2", dw2, t["dout"], t["hs"], p["rows"]["dout"], p["rows"]["hs"], p["plan"])


def _run_w13(p, out_dtype, cfg=None):
    t = p["tiles"]
    with _configured(cfg):
        dw1, dw3 = wgrad.expert_wgrad_w13_fp8(t["dg"], t["du"], t["x"], p["plan"], out_dtype)
    assert dw1.shape == dw3.shape == (p["E"], p["H"], p["D"]) and dw1.dtype == dw3.dtype == out_dtype
    r1 = _check("dW1", dw1, t["dg"], t["x"], p["rows"]["dg"], p["rows"]["x"], p["plan"])
    r3 = _check("dW3", dw3, t["du"], t["x"], p["rows"]["du"], p["rows"]["x"], p["plan"])
    return f"{r1} | {r3}"


# the interpreter's time goes by program, not by tile size: its larger shapes run 64 x 64 tiles
LARGE_INTERPRETED = TileConfig(64, 64, 128, 4, 1) if INTERPRET else None


@pytest.mark.parametrize("case", list(CASES))
def test_wgrad_fp8_cases(case):
    p = _problem(case)
    cfg = LARGE_INTERPRETED if p["D"] * p["H"] > 64 * 64 * 4 else None
    print(case, "max |err| / |A||B|^T, / peak:", _run_w2(p, torch.float32, cfg), _run_w13(p, torch.float32, cfg))


@pytest.mark.parametrize("case", ["segments", "empty", "outliers"])
def test_wgrad_fp8_bf16_out(case):
    p = _problem(case, seed=1)
    _run_w2(p, torch.bfloat16)
    _run_w13(p, torch.bfloat16)


# configs besides the default: pointer vs TMA loads, tiles that leave M / N edges
VARIANTS = {
    "tma": TileConfig(32, 32, 128, 4, 1, tma=True) if INTERPRET else TileConfig(128, 128, 128, 8, 4, tma=True),
    "pointer": TileConfig(32, 32, 128, 4, 1) if INTERPRET else TileConfig(128, 128, 128, 8, 4),
    "wide": TileConfig(64, 32, 128, 4, 1) if INTERPRET else TileConfig(64, 256, 128, 8, 3, tma=True),
    "narrow": TileConfig(32, 64, 128, 4, 1, tma=True) if INTERPRET else TileConfig(64, 128, 128, 4, 4, tma=True),
}


@pytest.mark.parametrize("case, variant", [("segments", "tma"), ("segments", "wide"), ("empty", "tma"),
                                           ("outliers", "pointer"), ("zero_rows", "narrow")])
def test_wgrad_fp8_config_variants(case, variant):
    p = _problem(case, seed=2)
    _run_w2(p, torch.float32, VARIANTS[variant])
    _run_w13(p, torch.float32, VARIANTS[variant])


# the persistent warp-specialised Gluon kernel (`kernels.fp8_wgrad_ws_gluon`), GPU only
GLUON_WS = TileConfig(128, 128, 128, 8, 4, tma=True, gluon=True, warp_specialize=True)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not CUDA, reason="Gluon kernels need a CUDA GPU (Triton's interpreter cannot run them)")
@pytest.mark.parametrize("case", ["segments", "empty", "outliers", "zero_rows", "skewed", "d128_h256"]
                         + (["gpu_d2048_h768"] if CUDA and not INTERPRET else []))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tma_store", [True, False], ids=["tma_store", "stores"])
def test_wgrad_fp8_gluon_ws(case, out_dtype, tma_store, monkeypatch):
    """The Gluon kernel under the same error bounds as the Triton kernel: ragged M and N edges, empty
    experts (zeros stored), outliers, all-zero rows, skewed routing; every element written (poisoned); the
    tiles stored through TMA (where M and N are multiples of 128 and shared memory has room; elsewhere, and
    with TMA_STORE off, by the consumers)."""
    from titan_megamoe.kernels import fp8_wgrad_ws_gluon as ws

    monkeypatch.setattr(ws, "TMA_STORE", tma_store)
    p = _problem(case, seed=3)
    _run_w2(p, out_dtype, GLUON_WS)
    _run_w13(p, out_dtype, GLUON_WS)
    _run_w13(p, out_dtype, replace(GLUON_WS, num_stages=2))  # dW1/dW3's 48 KB stages, the ring wrapping often


def test_gluon_ws_launcher_host_path(monkeypatch):
    """`fp8_wgrad_ws` on the host with the launch stubbed (the kernel needs a GPU): descriptors over the
    token tiles (A in 64-row halves, B in 128 rows), items = experts x row blocks x column blocks (dW1/dW3:
    both tiles in one item, DUAL, with the consumer registers it needs), one program per multiprocessor, the
    scales, both outputs."""
    import triton

    from titan_megamoe.kernels import fp8_rows_ws_gluon  # its launch_ws launches every warp-specialised kernel
    from titan_megamoe.kernels import fp8_wgrad_ws_gluon as ws

    p = _problem("segments")
    t, plan, E, D, H = p["tiles"], p["plan"], p["E"], p["D"], p["H"]
    seen = {}
    monkeypatch.setattr(fp8_rows_ws_gluon, "launch", lambda kernel, grid, *args, **kw: seen.update(
        kernel=kernel, grid=grid, args=args, kw=kw))
    monkeypatch.setattr(fp8_rows_ws_gluon, "multiprocessors", lambda device: 7)
    for a, a2, b, M, N in ((t["dg"], t["du"], t["x"], H, D), (t["dout"], None, t["hs"], D, H)):
        outs = [torch.empty(E, M, N, device=DEVICE) for _ in range(1 if a2 is None else 2)]
        ws.fp8_wgrad_ws(a, a2, b, plan, outs, stages=5, tma_store=False)
        items = E * triton.cdiv(M, 128) * triton.cdiv(N, 128)
        args = seen["args"]
        assert seen["kernel"] is ws._fp8_wgrad_ws_kernel and seen["grid"] == (min(items, 7),)
        assert [list(d.block_shape) for d in args[:3]] == [[64, 128], [64, 128], [128, 128]]
        assert args[3] is a.scale and args[4] is (a2 or a).scale and args[5] is b.scale
        assert torch.equal(args[6], plan.experts_by_load) and torch.equal(args[7], plan.expert_first_tile)
        assert args[8] is plan.offsets_E1 and args[9] is outs[0] and args[10] is outs[-1]
        assert args[11:13] == (None, None) and seen["kw"]["TMA_STORE"] is False  # tma_store=False
        assert args[13:18] == (items, triton.cdiv(M, 128), triton.cdiv(N, 128), M, N)
        assert args[18:20] == (a.scale.stride(0), b.scale.stride(0))
        ws.fp8_wgrad_ws(a, a2, b, plan, outs, stages=5, tma_store=True)  # descriptors over the outputs' 64-row halves
        assert seen["kw"]["TMA_STORE"] is (M % 128 == 0 and N % 128 == 0)
        if seen["kw"]["TMA_STORE"]:
            assert [list(d.block_shape) for d in seen["args"][11:13]] == [[64, 128], [64, 128]]
        assert seen["kw"]["STAGES"] == 5 and seen["kw"]["maxnreg"] == 168
        assert seen["kw"]["DUAL"] == (a2 is not None) and seen["kw"]["CONSUMER_REGS"] == (232 if a2 is None else 240)
        assert seen["kw"]["PRODUCER_REGS"] == 32


def test_wgrad_fp8_no_rows():
    plan = build_routing_plan(torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), 3, 128)
    q = quant.quantize_token_tiles(torch.zeros(0, 32, dtype=torch.bfloat16, device=DEVICE), plan)
    assert (wgrad.expert_wgrad_w2_fp8(q, q, plan, torch.float32) == 0).all()
    assert all((w == 0).all() for w in wgrad.expert_wgrad_w13_fp8(q, q, q, plan, torch.bfloat16))


def test_check_rejects_wrong_math():
    """The bound is tight enough to catch what a broken kernel would compute: the unquantized product, the
    data without its scales, or an expert's last tile left out."""
    p = _problem("segments")
    t, r, plan = p["tiles"], p["rows"], p["plan"]
    ref64, mag, peak = _ref_tiles(t["dout"], t["hs"], plan)
    assert _excess(ref64.float(), ref64, mag, peak) <= 1.0
    unquantized = torch.zeros_like(ref64)
    no_scales = torch.zeros_like(ref64)
    last_tile_dropped = torch.zeros_like(ref64)
    a, b = quant.dequantize(t["dout"]).double(), quant.dequantize(t["hs"]).double()
    for e, (t0, n, lo, hi) in enumerate(_expert_tiles(plan)):
        unquantized[e] = r["dout"][lo:hi].double().T @ r["hs"][lo:hi].double()
        cols = slice(128 * t0, 128 * (t0 + n))
        no_scales[e] = t["dout"].data[:, cols].double() @ t["hs"].data[:, cols].double().T
        cols = slice(128 * t0, 128 * (t0 + n - 1))
        last_tile_dropped[e] = a[:, cols] @ b[:, cols].T
    assert _excess(unquantized, ref64, mag, peak, mma_tol=0.0) > 1.0  # the interpreter's bound
    for wrong in (no_scales, last_tile_dropped):  # the GPU's bound too
        assert _excess(wrong, ref64, mag, peak) > 1.0 and _excess(wrong, ref64, mag, peak, mma_tol=2.0**-6) > 1.0


def test_wgrad_fp8_rejects_bad_inputs():
    p = _problem("k1")
    t, plan = p["tiles"], p["plan"]
    with pytest.raises(TypeError, match="BlockScaled"):
        wgrad.expert_wgrad_w2_fp8(t["dout"].data, t["hs"], plan, torch.float32)
    as_bf16 = BlockScaled(t["dout"].data.to(torch.bfloat16), t["dout"].scale, t["dout"].block)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        wgrad.expert_wgrad_w2_fp8(as_bf16, t["hs"], plan, torch.float32)
    other_plan = build_routing_plan(torch.zeros(1000, dtype=torch.int64, device=DEVICE), p["E"], 128)
    with pytest.raises(ValueError, match="token tiles of this plan"):
        wgrad.expert_wgrad_w2_fp8(t["dout"], t["hs"], other_plan, torch.float32)
    small_tiles = build_routing_plan(torch.zeros(plan.num_rows, dtype=torch.int64, device=DEVICE), p["E"], 16)
    with pytest.raises(ValueError, match="128-row tiles"):
        wgrad.expert_wgrad_w2_fp8(t["dout"], t["hs"], small_tiles, torch.float32)
    with pytest.raises(ValueError, match=r"data \[32, "):  # du with D rows where dg has H
        wgrad.expert_wgrad_w13_fp8(t["dg"], t["x"], t["x"], plan, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        wgrad.expert_wgrad_w2_fp8(t["dout"], t["hs"], plan, torch.float16)
    with pytest.raises(ValueError, match="block_k must be 128"), _configured(TileConfig(32, 32, 64, 4, 1)):
        wgrad.expert_wgrad_w2_fp8(t["dout"], t["hs"], plan, torch.float32)


@pytest.mark.skipif(INTERPRET or not CUDA, reason="GPU only: a Qwen3-30B-A3B layer (N = 131072 rows) is too big "
                                                  "for Triton's CPU interpreter")
@pytest.mark.parametrize("cfg", [None, GLUON_WS], ids=["table", "gluon_ws"])
def test_wgrad_fp8_qwen3_30b_layer(cfg):
    """D = 2048, H = 768, E = 128, T = 16384 tokens top-8: the error bound, and the achieved TFLOP/s (the
    table's config, and the Gluon kernel's)."""
    import triton.testing

    T, K, E, D, H = 16384, 8, 128, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randn(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
    plan = build_routing_plan(ids, E, 128)
    rows = {k: torch.randn(T * K, c, device="cuda", generator=gen).to(torch.bfloat16)
            for k, c in (("dout", D), ("hs", H), ("dg", H), ("du", H), ("x", D))}
    t = {k: quant.quantize_token_tiles(v, plan) for k, v in rows.items()}
    with _configured(cfg):
        dw2 = wgrad.expert_wgrad_w2_fp8(t["dout"], t["hs"], plan, torch.float32)
        dw1, dw3 = wgrad.expert_wgrad_w13_fp8(t["dg"], t["du"], t["x"], plan, torch.float32)
    for name, out, a, b in (("dW2", dw2, "dout", "hs"), ("dW1", dw1, "dg", "x"), ("dW3", dw3, "du", "x")):
        ref64, mag, peak = _ref_tiles(t[a], t[b], plan)
        excess = _excess(out, ref64, mag, peak)
        print(f"{name}: max |err| / |A||B|^T, / peak = {_relative_errors(out, ref64, mag, peak)} "
              f"({excess:.2f} of the bound)")
        assert excess <= 1.0, f"{name}: error {excess:.2f}x the bound"
        del ref64, mag, peak
    flop = 2 * T * K * D * H
    with _configured(cfg):
        ms_w2 = triton.testing.do_bench(lambda: wgrad.expert_wgrad_w2_fp8(t["dout"], t["hs"], plan, torch.bfloat16))
        ms_w13 = triton.testing.do_bench(lambda: wgrad.expert_wgrad_w13_fp8(t["dg"], t["du"], t["x"], plan,
                                                                              torch.bfloat16))
    print(f"wgrad_w2 fp8 {ms_w2:.3f} ms {flop / ms_w2 * 1e-9:.0f} TFLOP/s; "
          f"wgrad_w13 fp8 {ms_w13:.3f} ms {2 * flop / ms_w13 * 1e-9:.0f} TFLOP/s")


# In a fresh process: with TRITON_INTERPRET=1 in this one, triton's own library functions are interpreted
# too, so a real compile cannot happen here. The signature is scripts/sm90_resources.py's (one definition of
# how the launcher calls the kernel), at the shipped config's tiles.
_SM90_COMPILE = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import gluon_wgrad_ws, wgrad_fp8
from titan_megamoe.kernels.configs import tile_config

def compile_sm90(kind):
    cfg = tile_config(f"wgrad_{kind}", 2048, 768, "fp8")
    assert cfg.tma, "wgrad_fp8 compiles the TMA form, which the shipped FP8 config must be"
    if cfg.gluon:  # the persistent warp-specialised Gluon kernel (its launch shape is its own)
        res = gluon_wgrad_ws(cfg.num_stages, dual=kind == "w13")
    else:
        res = wgrad_fp8(kind == "w13", cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    return dict(config=[cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.gluon], **res)

print(json.dumps({kind: compile_sm90(kind) for kind in ("w2", "w13")}))
"""


@pytest.fixture(scope="module")
def sm90_compiles():
    from moe_cases import sm90_compile_results

    return sm90_compile_results(_SM90_COMPILE, timeout=300)


@pytest.mark.parametrize("kind", ["w2", "w13"])
def test_fp8_default_config_compiles_to_fp8_wgmma_on_sm90(sm90_compiles, kind):
    """The shipped FP8 config at Qwen3-30B-A3B's shape compiled for sm_90 on the CPU (Triton bundles ptxas
    and cuobjdump), the Gluon kernel where the table picks it: the GEMM must be an FP8 wgmma (QGMMA in the
    SASS), with nothing spilled to the stack."""
    from moe_cases import stack_bytes

    res = sm90_compiles[kind]
    print(kind, res)
    assert res["wgmma_ir"], "the GEMM did not lower to a warp-group (wgmma) dot"
    assert res["qgmma"] > 0, "no QGMMA (FP8 wgmma) instruction in the SASS"
    stack = stack_bytes(res["usage"])
    if stack and res["config"][:3] == [128, 128, 8] and not res["config"][4]:
        # configs.py's first FP8 choice: two (w13) or one (w2) 128 x 128 fp32 accumulators plus the
        # per-tile partial and the prefetched scales exceed 255 registers. Measured on an H200 at D=2048,
        # H=768: w2 1.55 ms vs 0.94 ms at 64 x 128 (4 warps, 4 stages), w13 4.37 ms vs 1.87 ms at 64 x 256
        # (8 warps, 3 stages), both spill-free; this turns into a failure once the default changes
        pytest.xfail(f"the default FP8 {kind} config 128x128/8 warps spills ({res['usage']})")
    if kind == "w13" and res["config"][4]:
        # the Gluon dW1/dW3 (DUAL): two accumulators, the product and 32 column scales a thread at 240
        # registers; sm_90 (Triton 3.6) keeps a few loop values in local memory (32 bytes at 3 stages since
        # the producer stages the scales, 72 before, L1). A bound, not a pass: more is a regression
        assert stack <= 72, f"register spills: {res['usage']}"
        return
    if res["config"][4]:
        # the Gluon dW2: none in Triton 3.6's compile (the GPU machine's), 24 bytes of loop values in 3.9's
        # (CI's) since the producer stages the scales. A bound, not a pass: more is a regression
        assert stack <= 24, f"register spills: {res['usage']}"
        return
    assert stack == 0, f"register spills: {res['usage']}"
