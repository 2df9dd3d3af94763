#!/usr/bin/env python3
"""Per-layer benchmark: TorchTitan 0.2.2's stock MoE layer vs the mega_moe layer, same weights and tokens,
in every precision asked for (the benchmark that issues 10 and 14 read).

For each case it builds one stock `torchtitan.models.moe.MoE` (bf16, on the GPU) and, for each
--precision, a copy swapped to the fused backend in that precision. Two fused arms per precision: `fused`
(fused router and expert kernels) and `fused_stock_router` (TorchTitan's router module kept, the
`[mega_moe] fused_router = false` path): the expert path alone, the headline ratio. Stock is bf16 and is
measured once per case, in the same interleaved rounds as every fused arm.

Before timing, each (case, precision) is checked on fresh random tokens and weights (never zeros):
  every precision  relative L2 of the output and every gradient against stock (bf16) -> `rel_l2_vs_stock`;
                   for bf16 at most 5e-2 (both are bf16 with different rounding points: ~1e-3 is normal);
  fp8, fp8_bwd     the fused experts on the case's first CHECK_TOKENS tokens against the reference
                   backend's emulation of the same recipe (`moe(..., backend="reference", precision=p)`),
                   both against an fp32 reference: the error of the output and every gradient at most
                   2x the emulation's, and where the recipe quantizes (the output for fp8, dx for both)
                   at least 0.3x of it: a bf16 result is ~10x more accurate, so a silent bf16 fallback
                   fails -> `emulation_check`.
A (case, precision) the kernels reject (NotImplementedError / ValueError: the Triton FP8 kernels not
written yet, FP8 on D or H not a multiple of 128) is a row with `skipped: <the error>`; one that fails
its check or raises anything else (a kernel that does not compile, ...) is a row with `failed: <why>`,
not timed; the other rows still run, and the script exits 1 after writing everything.

Timing: CUDA events around each call, median of --iters after --warmup, in --rounds rounds that each visit
every arm (a slow drift of the machine spreads over all arms). Two timings per measurement:
  synchronised   the GPU is idle when each call starts, so the call's host launch latency up to its
                 first long kernel is in the time (an upper bound; a lone layer with nothing queued);
  back-to-back   calls queue behind each other with one synchronisation at the end (the method of
                 triton.testing.do_bench): the host runs ahead as it does in a training step.
TFLOP/s use the peers' convention (titan_megamoe.flops: fwd 6*T*K*D*H, fwd+bwd 18*T*K*D*H), the same
count for every precision. Peak memory of forward+backward per arm.

Budget: --max-seconds stops starting cases once spent (their rows say `skipped: not run: ...` and the
JSON lists them in `not_run`); a case whose estimated peak (`estimate_peak_gib`) exceeds the GPU's free
memory is skipped with the estimate. The JSON (--out/bench_layer_<UTC stamp>.json: GPU, torch, triton,
commit (TITAN_MEGAMOE_COMMIT overrides git), date, argv, every timing) is rewritten after each case, so a
killed run keeps what it measured; a table is printed last.

One JSON row per (case, precision):
  case, T, D, H, E, K, routing, routing_desc, precision, est_peak_gib, rows_per_expert{min,max,mean,top8_share}
  skipped | failed      (str; such a row has no timings, and a row not run no rows_per_expert either)
  rel_l2_vs_stock{out,dx,<param>...}, emulation_check{tokens,tensors{name:{err,emulation_err,ratio}}} (fp8*)
  rounds, case_seconds
  {arm}_{fwd,fwdbwd,fwd_b2b,fwdbwd_b2b}_ms and _all (every sample), arm in stock, fused, fused_stock_router
  {arm}_{fwd,fwdbwd}_tflops, {arm}_{fwd,fwdbwd}_b2b_tflops, {arm}_fwdbwd_peak_gib
  fwd_speedup, fwdbwd_speedup, fwd_b2b_speedup, fwdbwd_b2b_speedup           (stock ms / fused ms)
  fused_stock_router_{fwd,fwdbwd,fwd_b2b,fwdbwd_b2b}_speedup                 (the headline: experts alone)
  vs_bf16_fwd, vs_bf16_fwdbwd, fused_stock_router_vs_bf16_{fwd,fwdbwd}       (non-bf16 rows, bf16 measured:
                                                                              bf16 fused ms / this row's ms)
  with --sac: stock_sac_*, fused_sac_recompute_*, fused_sac_save_* (_fwdbwd_ms, _peak_gib) or sac_skipped
  with --sac or --full-ac: stock_full_ac_*, fused_full_ac_* (_fwdbwd_ms, _peak_gib: the layer under full
             activation checkpointing)

    python scripts/bench_layer.py                                  # every default case, bf16
    python scripts/bench_layer.py --precision bf16,fp8,fp8_bwd      # the precision column
    python scripts/bench_layer.py --cases 30b-16k --iters 50 --max-seconds 600
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import NamedTuple

import torch

from titan_megamoe.flops import moe_flops
from titan_megamoe.precision import Precision

from results_tables import whole_recompute_estimate_ms  # scripts/: one formula for the table and this line

DEVICE = "cuda"  # the tests run the whole script on CPU (Triton interpreter) by changing this
clock = time.monotonic  # the --max-seconds budget's clock (tests replace it)


class Case(NamedTuple):
    T: int
    D: int
    H: int
    E: int
    K: int
    routing: str


# routing: (expert_bias[e] = scale / (e + 1), added to the scores for selection only; what it does)
ROUTINGS = {
    "softmax": (0.0, "TorchTitan's softmax top-K router (route_norm), no bias: near-uniform load"),
    "skewed": (0.02, "expert_bias[e] = 0.02/(e+1), selection only (Zipf-like preference for low ids): at 30B "
                     "T=16384 one expert takes ~3/4 of the tokens, the 8 busiest experts ~18% of the rows"),
    "hot": (0.1, "expert_bias[e] = 0.1/(e+1), selection only: at 30B T=16384 experts 0-2 take (nearly) every "
                 "token, the 8 busiest experts ~half of the rows"),
}

# The default case list, in the order it runs (the targets' shapes first, so --max-seconds cuts the rest)
CASES = {
    "30b-16k": Case(16384, 2048, 768, 128, 8, "softmax"),  # Qwen3-30B-A3B
    "235b-16k": Case(16384, 4096, 1536, 128, 8, "softmax"),  # Qwen3-235B-A22B
    "mixtral-8k": Case(8192, 4096, 14336, 8, 2, "softmax"),  # Mixtral-8x7B-like
    "olmoe-8k": Case(8192, 2048, 1024, 64, 8, "softmax"),  # OLMoE-like
    "30b-512": Case(512, 2048, 768, 128, 8, "softmax"),
    "30b-4k": Case(4096, 2048, 768, 128, 8, "softmax"),
    "30b-64k": Case(65536, 2048, 768, 128, 8, "softmax"),
    "30b-16k-skewed": Case(16384, 2048, 768, 128, 8, "skewed"),
    "30b-16k-hot": Case(16384, 2048, 768, 128, 8, "hot"),
    "odd-777": Case(777, 832, 320, 40, 5, "softmax"),  # no dimension a power of two; FP8 rejects D, H
    "235b-64k": Case(65536, 4096, 1536, 128, 8, "softmax"),
}

MAX_REL_L2_BF16 = 5e-2  # bf16 vs stock: ~1e-3 is normal, an order of magnitude more is a broken kernel
CHECK_TOKENS = 1024  # tokens of the FP8 check against the emulation (host-synchronising: kept small)
FP8_MAX_ERROR_RATIO = 2.0  # the kernels' error at most 2x the emulation's (issue 14's oracle rule)
FP8_MIN_ERROR_RATIO = 0.3  # ... and where the recipe quantizes, at least this much (bf16 measured 0.06-0.15x)


def build_layers(T, D, H, E, K, routing, seed=0, backend="triton"):
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from titan_megamoe.integrations.torchtitan.converter import swap_moe_layers

    args = MoEArgs(num_experts=E, num_shared_experts=0, top_k=K, score_func="softmax", route_norm=True,
                   score_before_experts=False, load_balance_coeff=1e-3)
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        stock = MoE(args, dim=D, hidden_dim=H)
    with torch.no_grad():
        stock.init_weights(init_std=0.02, buffer_device=torch.device(DEVICE))
    bias_scale = ROUTINGS[routing][0]
    if bias_scale:
        # expert_bias only changes which experts are chosen: a Zipf-like preference for low ids
        stock.expert_bias.copy_(bias_scale / torch.arange(1, E + 1, device=DEVICE).float())
    stock = stock.to(torch.bfloat16)
    stock.expert_bias = stock.expert_bias.float()
    stock.tokens_per_expert = stock.tokens_per_expert.float()
    fused = copy.deepcopy(stock)
    swap_moe_layers(fused, "bf16", backend)
    x = torch.randn(1, T, D, device=DEVICE, dtype=torch.bfloat16)
    return stock, fused, x


def with_stock_router(fused):
    """The fused layer with TorchTitan's router module in place of the fused router (mega_moe.fused_router
    = false): isolates what the expert kernels alone gain."""
    layer = copy.deepcopy(fused)
    layer.fused_router = False
    return layer


def run_fwd_bwd(layer, x, dout):
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(dout)
    return out, x.grad


def local(t):
    """This rank's part of a DTensor (expert weights and their gradients under EP); a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def layer_results(layer, x, dout):
    """The output, dx and every parameter's gradient of one forward+backward, in fp32 (gradients freed)."""
    out, dx = run_fwd_bwd(layer, x, dout)
    res = {"out": out.float(), "dx": dx.float(),
           **{n: local(p.grad).float().clone() for n, p in layer.named_parameters()}}
    layer.zero_grad(set_to_none=True)
    return res


def rel_l2(ref, got):
    return {k: ((got[k] - r).norm() / r.norm().clamp_min(1e-30)).item() for k, r in ref.items()}


def check_against_stock(stock, fused, x, dout):
    """Relative L2 error of fused vs stock for the output and every gradient (both bf16); under EP, of
    this rank's shard of each expert-weight gradient."""
    rel = rel_l2(layer_results(stock, x, dout), layer_results(fused, x, dout))
    bad = [k for k, v in rel.items() if not math.isfinite(v)]
    assert not bad, f"fused {bad} have non-finite values"
    return rel


def emulation_check(stock, layer, x, precision, tokens=CHECK_TOKENS):
    """The layer's experts module (as configured: the precision it runs is the one timed) on the first
    `tokens` tokens, routed by stock's router, against the reference backend's emulation of `precision`:
    max |error| of each against an fp32 reference, for the output and every gradient."""
    from titan_megamoe import moe
    from titan_megamoe.oracle import moe_reference

    x_TD = x.view(-1, x.shape[-1])[:tokens].detach()
    with torch.no_grad():
        scores_TK, ids_TK = stock.router(x_TD, stock.expert_bias)[:2]
    ex = layer.experts
    dout_TD = torch.randn_like(x_TD)

    def leaves(dtype=None):
        return [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (x_TD, scores_TK, ex.w1, ex.w2, ex.w3)]

    def results(out, xs, s, w1, w2, w3):
        out.backward(dout_TD.to(out.dtype))
        return {"out": out.detach(), "dx": xs.grad, "dscores": s.grad, "dw1": w1.grad, "dw2": w2.grad, "dw3": w3.grad}

    xs, s = leaves()[:2]
    layer.zero_grad(set_to_none=True)
    got = results(ex(xs, ids_TK, s), xs, s, ex.w1, ex.w2, ex.w3)
    got = {k: local(v).float() for k, v in got.items()}
    layer.zero_grad(set_to_none=True)
    xs, s, w1, w2, w3 = leaves()
    emu = results(moe(xs, ids_TK, s, w1, w2, w3, precision=precision, backend="reference"), xs, s, w1, w2, w3)
    xs, s, w1, w2, w3 = leaves(torch.float32)
    ref = results(moe_reference(xs, ids_TK, s, w1, w2, w3, compute_dtype=torch.float32), xs, s, w1, w2, w3)
    tensors = {}
    for name, r in ref.items():
        err = (got[name] - r).abs().max().item()
        emu_err = (emu[name].float() - r).abs().max().item()
        floor = 2.0**-9 * r.abs().max().item()  # one bf16 rounding of the largest value (tests/moe_cases.py)
        tensors[name] = {"err": err, "emulation_err": emu_err, "ratio": err / max(emu_err, floor, 1e-30)}
    return {"tokens": x_TD.shape[0], "tensors": tensors}


def check_failure(row):
    """Why a checked row must not be timed, or None."""
    p, rel = row["precision"], row["rel_l2_vs_stock"]
    bad = [k for k, v in rel.items() if not math.isfinite(v)]
    if bad:
        return f"fused {p} has non-finite values in {', '.join(bad)}; not timing a wrong kernel"
    if p == Precision.BF16.value:
        worst = max(rel, key=rel.get)
        if rel[worst] > MAX_REL_L2_BF16:
            return (f"fused bf16 differs from stock ({worst}: relative L2 {rel[worst]:.2e} > {MAX_REL_L2_BF16}); "
                    f"not timing a wrong kernel")
        return None
    tensors = row["emulation_check"]["tensors"]
    over = {k: t["ratio"] for k, t in tensors.items() if not t["ratio"] <= FP8_MAX_ERROR_RATIO}
    if over:
        return (f"fused {p} error above {FP8_MAX_ERROR_RATIO}x the emulation's (error ratios "
                f"{', '.join(f'{k} {v:.2f}x' for k, v in over.items())}); not timing a wrong kernel")
    quantized = ["dx"] if p == Precision.FP8_BWD.value else ["out", "dx"]
    low = {k: tensors[k]["ratio"] for k in quantized if tensors[k]["ratio"] < FP8_MIN_ERROR_RATIO}
    if low:
        return (f"fused {p} is not measurably {p}: error ratios {', '.join(f'{k} {v:.2f}x' for k, v in low.items())} "
                f"of the emulation's, below {FP8_MIN_ERROR_RATIO}x (a bf16 result gives ~0.1x: a silent fallback?)")
    return None


class HostClockEvent:
    """torch.cuda.Event's timing calls on the host clock: CPU runs (tests, gloo) have no device events."""

    def __init__(self):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def timing_event():
    return torch.cuda.Event(enable_timing=True) if DEVICE == "cuda" else HostClockEvent()


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(iters):
        start, end = timing_event(), timing_event()
        start.record()
        fn()
        end.record()
        synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def time_back_to_back_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    synchronize()
    events = [(timing_event(), timing_event()) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return statistics.median(times), times


def interleaved(measurements, warmup, iters, rounds):
    """All samples of every measurement {key: (fn, timer)}, taken in `rounds` rounds that each visit
    every measurement once (ceil(iters / rounds) calls per visit): a slow drift of the machine (GPU
    clocks under sustained load, host speed) spreads over all arms instead of landing on the last one."""
    samples = {key: [] for key in measurements}
    per_visit = -(-iters // rounds)
    for r in range(rounds):
        for key, (fn, timer) in measurements.items():
            samples[key] += timer(fn, warmup if r == 0 else 1, per_visit)[1]
    return samples


def peak_mem_gib(fn, layer):
    """Peak memory of fn above what is allocated before it (inputs, weights), gradients freed first."""
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def full_ac_fwd_bwd(layer, x, dout):
    """forward+backward under full activation checkpointing, as TorchTitan's `mode = "full"` wraps a block
    (non-reentrant `torch.utils.checkpoint`): the backward recomputes what it needs of the forward."""
    from torch.utils.checkpoint import checkpoint

    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)  # as `run_fwd_bwd`: fresh gradients, no accumulation timed
    checkpoint(layer, x, use_reentrant=False).backward(dout)


def sac_fwd_bwd(layer, x, dout, save_ops):
    """forward+backward under op-level selective AC saving `save_ops` (like qwen3's op-SAC)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)  # as `run_fwd_bwd`: fresh gradients, no accumulation timed
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    out = checkpoint(layer, x, use_reentrant=False, context_fn=ctx_fn)
    out.backward(dout)


def estimate_peak_gib(case, n_precisions):
    """A rough upper bound on one case's GPU memory: the expert weights (bf16) and their gradients for stock
    and one fused layer per precision, 6 more weight copies' worth for the checks (fp32 gradient copies,
    the fp32 reference's weights and gradients, FP8 weight copies), and stock's forward+backward
    activations, 2*T*K*(6D + 6H) bytes (measured on the H200 below that: 2.8 GiB at 30B and 3.5 GiB at
    235B, T=16384)."""
    T, D, H, E, K = case[:5]
    weights = 3 * E * H * D * 2
    return ((2 + 2 * n_precisions + 6) * weights + 2 * T * K * (6 * D + 6 * H) + 3 * T * D * 2) / 2**30


def free_memory_gib():
    """What the GPU has free now; None off the GPU (no estimate is applied)."""
    return torch.cuda.mem_get_info()[0] / 2**30 if DEVICE == "cuda" else None


def case_fields(name, n_precisions):
    case = Case(*CASES[name])
    return {"case": name, **case._asdict(), "routing_desc": ROUTINGS[case.routing][1],
            "est_peak_gib": round(estimate_peak_gib(case, n_precisions), 1)}


def one_line(e: BaseException) -> str:
    """The error on one line, its direct cause first (a Triton CompilationError's own text is source code)."""
    text = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if e.__cause__ is not None:
        text = f"{one_line(e.__cause__)} -> {text}"
    return text


def arm_calls(layer, fused_router, x, x_req, dout):
    """(forward, forward+backward) of one arm; a fused layer serves both fused arms, its router set per call."""
    def configure():
        if fused_router is not None:
            layer.fused_router = fused_router

    def fwd():  # training-mode forward: autograd records residuals
        configure()
        return layer(x_req)

    def fwd_bwd():
        configure()
        return run_fwd_bwd(layer, x, dout)

    return fwd, fwd_bwd


FUSED_ARMS = {"fused": True, "fused_stock_router": False}
KINDS = {"fwd": time_ms, "fwdbwd": time_ms, "fwd_b2b": time_back_to_back_ms, "fwdbwd_b2b": time_back_to_back_ms}


def bench_case(name, precisions, warmup, iters, checkpointing=frozenset(), rounds=1, backend="triton"):
    """One row per precision: checked, then (if it passes) timed against stock, all arms interleaved."""
    t0 = clock()
    case = Case(*CASES[name])
    T, D, H, E, K, _ = case
    stock, fused, x = build_layers(*case, backend=backend)
    dout = torch.randn_like(x)
    with torch.no_grad():
        ids = stock.router(x.view(-1, D), stock.expert_bias)[1]
        counts = torch.bincount(ids.flatten(), minlength=E).sort(descending=True).values
    base = {**case_fields(name, len(precisions)),
            "rows_per_expert": {"min": int(counts[-1]), "max": int(counts[0]), "mean": float(counts.float().mean()),
                                "top8_share": float(counts[:8].sum() / counts.sum())}}
    stock_ref = layer_results(stock, x, dout)
    rows, layers = {}, {}
    for p in precisions:
        layer = fused if p == precisions[0] else copy.deepcopy(fused)
        layer.experts.precision = p
        row = rows[p] = {**base, "precision": p}
        try:
            row["rel_l2_vs_stock"] = rel_l2(stock_ref, layer_results(layer, x, dout))
            if p != Precision.BF16.value:
                row["emulation_check"] = emulation_check(stock, layer, x, p)
        except (NotImplementedError, ValueError) as e:  # the kernels reject this (case, precision)
            row["skipped"] = one_line(e)
            continue
        except Exception as e:  # a kernel that breaks (compile error, ...): this row fails, the run goes on
            traceback.print_exc()
            row["failed"] = one_line(e)[:2000]
            continue
        finally:
            layer.zero_grad(set_to_none=True)
        failure = check_failure(row)
        if failure:
            row["failed"] = failure
        else:
            layers[p] = layer
    del stock_ref
    if layers:
        time_arms(rows, layers, stock, x, dout, warmup, iters, rounds, checkpointing, case)
    del stock, fused, layers
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    for row in rows.values():
        row["case_seconds"] = round(clock() - t0, 1)
    return list(rows.values())


def time_arms(rows, layers, stock, x, dout, warmup, iters, rounds, checkpointing, case):
    """Stock once and both fused arms of each precision in `layers`, interleaved; fills their rows.
    `checkpointing`: which of "sac" (op-level selective) and "full_ac" to time besides, after the plain arms."""
    x_req = x.detach().requires_grad_(True)
    arms = {"stock": (stock, None)}
    arms.update({f"{p}/{arm}": (layer, fr) for p, layer in layers.items() for arm, fr in FUSED_ARMS.items()})
    measurements, fwd_bwd = {}, {}
    for key, (layer, fr) in arms.items():
        fwd, fwd_bwd[key] = arm_calls(layer, fr, x, x_req, dout)
        for kind, timer in KINDS.items():
            measurements[f"{key}_{kind}"] = (fwd_bwd[key] if kind.startswith("fwdbwd") else fwd, timer)
    samples = interleaved(measurements, warmup, iters, rounds)
    peaks = {key: peak_mem_gib(fwd_bwd[key], layer) for key, (layer, _) in arms.items()}
    stock_fields = {}
    for kind in KINDS:
        s = samples[f"stock_{kind}"]
        stock_fields.update({f"stock_{kind}_ms": statistics.median(s), f"stock_{kind}_all": s})
    stock_fields["stock_fwdbwd_peak_gib"] = peaks["stock"]
    if "sac" in checkpointing:
        from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

        fn = functools.partial(sac_fwd_bwd, stock, x, dout, set(_op_sac_save_list))
        stock_fields["stock_sac_fwdbwd_ms"] = time_ms(fn, warmup, iters)[0]
        stock_fields["stock_sac_peak_gib"] = peak_mem_gib(fn, stock)
    if "full_ac" in checkpointing:
        fn = functools.partial(full_ac_fwd_bwd, stock, x, dout)
        stock_fields["stock_full_ac_fwdbwd_ms"] = time_ms(fn, warmup, iters)[0]
        stock_fields["stock_full_ac_peak_gib"] = peak_mem_gib(fn, stock)
    for p, layer in layers.items():
        row = rows[p]
        row["rounds"] = rounds
        row.update(stock_fields)
        for arm in FUSED_ARMS:
            for kind in KINDS:
                s = samples[f"{p}/{arm}_{kind}"]
                row[f"{arm}_{kind}_ms"], row[f"{arm}_{kind}_all"] = statistics.median(s), s
            row[f"{arm}_fwdbwd_peak_gib"] = peaks[f"{p}/{arm}"]
        if "sac" in checkpointing:
            time_sac(row, layer, x, dout, warmup, iters)
        if "full_ac" in checkpointing:
            time_full_ac(row, layer, x, dout, warmup, iters)
        add_rates(row, case)
    bf16 = rows.get(Precision.BF16.value)
    for p, row in rows.items():
        if p != Precision.BF16.value and p in layers and bf16 is not None and "fused_fwd_ms" in bf16:
            for arm, prefix in (("fused", ""), ("fused_stock_router", "fused_stock_router_")):
                for kind in ("fwd", "fwdbwd"):
                    row[f"{prefix}vs_bf16_{kind}"] = bf16[f"{arm}_{kind}_ms"] / row[f"{arm}_{kind}_ms"]


def time_sac(row, layer, x, dout, warmup, iters):
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

    layer.fused_router = True  # as the fused arm (under SAC's dispatch mode the layer uses the stock router)
    from titan_megamoe.integrations.torchtitan.converter import sac_save_ops

    # torch.utils.checkpoint stops the recompute early by default: as TorchTitan with activation_checkpoint.early_stop
    variants = {"fused_sac_recompute": set(_op_sac_save_list),
                "fused_sac_save": set(_op_sac_save_list) | set(sac_save_ops(early_stop=True))}
    try:
        for key, ops in variants.items():
            fn = functools.partial(sac_fwd_bwd, layer, x, dout, ops)
            row[f"{key}_fwdbwd_ms"], _ = time_ms(fn, warmup, iters)
            row[f"{key}_peak_gib"] = peak_mem_gib(fn, layer)
    except (NotImplementedError, ValueError) as e:  # e.g. a precision the custom op does not run yet
        row["sac_skipped"] = one_line(e)


def time_full_ac(row, layer, x, dout, warmup, iters):
    # the eager path (no dispatch mode) with the fused router, as the `fused` arm; it needs nothing of the package
    # but the layer, so that a revision from before these fields existed is timed the same way
    layer.fused_router = True
    fn = functools.partial(full_ac_fwd_bwd, layer, x, dout)
    row["fused_full_ac_fwdbwd_ms"], _ = time_ms(fn, warmup, iters)
    row["fused_full_ac_peak_gib"] = peak_mem_gib(fn, layer)


def add_rates(row, case):
    T, D, H, E, K, _ = case
    for kind, fl in (("fwd", moe_flops(T, K, D, H, backward=False)), ("fwdbwd", moe_flops(T, K, D, H))):
        for arm in ("stock", *FUSED_ARMS):
            row[f"{arm}_{kind}_tflops"] = fl / (row[f"{arm}_{kind}_ms"] * 1e-3) / 1e12
            row[f"{arm}_{kind}_b2b_tflops"] = fl / (row[f"{arm}_{kind}_b2b_ms"] * 1e-3) / 1e12
        for suffix in ("", "_b2b"):
            row[f"{kind}{suffix}_speedup"] = row[f"stock_{kind}{suffix}_ms"] / row[f"fused_{kind}{suffix}_ms"]
            row[f"fused_stock_router_{kind}{suffix}_speedup"] = (row[f"stock_{kind}{suffix}_ms"]
                                                                 / row[f"fused_stock_router_{kind}{suffix}_ms"])


def environment(device_name=None):
    """Where the run ran; device_name: what to record instead of the CUDA device's name (a CPU run)."""
    import triton
    import torchtitan

    from titan_megamoe.ab.environment import git_commit

    git = git_commit() or {}
    return {"gpu": device_name or torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "torchtitan": getattr(torchtitan, "__version__", "?"), "commit": git.get("commit"),
            "dirty": git.get("dirty"), "commit_source": git.get("repo"),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "argv": sys.argv}


def result_path(out_dir, prefix):
    """Where a run writes its JSON: <out_dir>/<prefix>_<UTC time>.json (the folder made if needed)."""
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, f"{prefix}_{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S')}.json")


def progress_line(prefix, r):
    """One short line per row."""
    if "skipped" in r or "failed" in r:
        what = "skipped" if "skipped" in r else "FAILED"
        msg = r.get("skipped") or r["failed"]
        return f"{prefix} {r['precision']}: {what} ({msg[:140]}{'...' if len(msg) > 140 else ''})"
    vs = f", {r['vs_bf16_fwdbwd']:.2f}x bf16" if "vs_bf16_fwdbwd" in r else ""
    return (f"{prefix} {r['precision']}: f+b {r['stock_fwdbwd_ms']:.2f} -> experts {r['fused_stock_router_fwdbwd_ms']:.2f} ms "
            f"({r['fused_stock_router_fwdbwd_speedup']:.2f}x, {r['fused_stock_router_fwdbwd_tflops']:.0f} TF/s), "
            f"+router {r['fused_fwdbwd_ms']:.2f} ms ({r['fwdbwd_speedup']:.2f}x){vs}; "
            f"fwd {r['stock_fwd_ms']:.2f} -> {r['fused_stock_router_fwd_ms']:.2f} / {r['fused_fwd_ms']:.2f} ms "
            f"[{r['case_seconds']:.0f} s]")


def print_table(results):
    hdr = (f"{'case':<16}{'prec':<8}{'stock fwd':>10}{'fused fwd':>10}{'x':>6}{'TF/s':>6}{'stock f+b':>10}"
           f"{'fused f+b':>10}{'x':>6}{'TF/s':>6}{'vs bf16':>8}{'mem s/f GiB':>14}")
    print(hdr)
    for r in results:
        lead = f"{r['case']:<16}{r['precision']:<8}"
        if "skipped" in r or "failed" in r:
            print(f"{lead}{'skipped: ' + r['skipped'] if 'skipped' in r else 'FAILED: ' + r['failed']}")
            continue
        vs = f"{r['fused_stock_router_vs_bf16_fwdbwd']:>8.2f}" if "vs_bf16_fwdbwd" in r else f"{'':>8}"
        print(f"{lead}{r['stock_fwd_ms']:>10.2f}{r['fused_stock_router_fwd_ms']:>10.2f}"
              f"{r['fused_stock_router_fwd_speedup']:>6.2f}{r['fused_stock_router_fwd_tflops']:>6.0f}"
              f"{r['stock_fwdbwd_ms']:>10.2f}{r['fused_stock_router_fwdbwd_ms']:>10.2f}"
              f"{r['fused_stock_router_fwdbwd_speedup']:>6.2f}{r['fused_stock_router_fwdbwd_tflops']:>6.0f}{vs}"
              f"{r['stock_fwdbwd_peak_gib']:>7.2f}/{r['fused_stock_router_fwdbwd_peak_gib']:.2f}  experts (stock router)")
        vs = f"{r['vs_bf16_fwdbwd']:>8.2f}" if "vs_bf16_fwdbwd" in r else f"{'':>8}"
        print(f"{'':<24}{'':>10}{r['fused_fwd_ms']:>10.2f}{r['fwd_speedup']:>6.2f}{r['fused_fwd_tflops']:>6.0f}"
              f"{'':>10}{r['fused_fwdbwd_ms']:>10.2f}{r['fwdbwd_speedup']:>6.2f}{r['fused_fwdbwd_tflops']:>6.0f}{vs}"
              f"{'':>7}/{r['fused_fwdbwd_peak_gib']:.2f}  + fused router")
        print(f"{'':<24}{r['stock_fwd_b2b_ms']:>10.2f}{r['fused_fwd_b2b_ms']:>10.2f}{r['fwd_b2b_speedup']:>6.2f}"
              f"{r['fused_fwd_b2b_tflops']:>6.0f}{r['stock_fwdbwd_b2b_ms']:>10.2f}{r['fused_fwdbwd_b2b_ms']:>10.2f}"
              f"{r['fwdbwd_b2b_speedup']:>6.2f}{r['fused_fwdbwd_b2b_tflops']:>6.0f}{'':>8}{'':>14}  back-to-back (fused router)")
        if "stock_sac_fwdbwd_ms" in r and "fused_sac_save_fwdbwd_ms" in r:
            print(f"{'':<24}op-SAC: stock {r['stock_sac_fwdbwd_ms']:.2f} ms {r['stock_sac_peak_gib']:.2f} GiB | fused "
                  f"recompute {r['fused_sac_recompute_fwdbwd_ms']:.2f} ms {r['fused_sac_recompute_peak_gib']:.2f} GiB"
                  f" | fused save {r['fused_sac_save_fwdbwd_ms']:.2f} ms {r['fused_sac_save_peak_gib']:.2f} GiB")
        if "fused_full_ac_fwdbwd_ms" in r:
            print(f"{'':<24}full AC: stock {r['stock_full_ac_fwdbwd_ms']:.2f} ms {r['stock_full_ac_peak_gib']:.2f} GiB"
                  f" | fused {r['fused_full_ac_fwdbwd_ms']:.2f} ms {r['fused_full_ac_peak_gib']:.2f} GiB (a whole "
                  f"recompute, estimated: {whole_recompute_estimate_ms(r):.2f} ms)")


def checkpointing(args) -> frozenset:
    """Which activation-checkpointing arms the command line asks for (`time_arms`)."""
    return frozenset(({"sac", "full_ac"} if args.sac else set()) | ({"full_ac"} if args.full_ac else set()))


def parse_precisions(text, ap):
    out = []
    for item in text.split(","):
        try:
            p = Precision.parse(item.strip()).value
        except ValueError as e:
            ap.error(f"--precision: {e}")
        if p not in out:
            out.append(p)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--precision", default="bf16",
                    help="comma-separated fused precisions, each timed against the same stock bf16 layer "
                         "(e.g. bf16,fp8,fp8_bwd); default bf16")
    ap.add_argument("--backend", default="triton", choices=["triton", "reference"],
                    help="the fused layers' backend (reference: the pure-PyTorch oracle, for checking the script)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleave the arms: each round times every arm once, --iters split over the rounds")
    ap.add_argument("--sac", action="store_true",
                    help="also time activation checkpointing: op-level selective (recompute vs save) and full, "
                         "with torch.utils.checkpoint's early stop (TorchTitan: activation_checkpoint.early_stop)")
    ap.add_argument("--full-ac", action="store_true",
                    help="also time full activation checkpointing, without op-level SAC (--sac times both); it "
                         "needs nothing newer of the package than the layer, so an older revision can be timed")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no case once this many seconds have passed (those cases are recorded as not run)")
    ap.add_argument("--out", default="docs/results", help="directory for the JSON file")
    ap.add_argument("--tile-table", default=None,
                    help="a table file from `titan-megamoe tune`, used before the shipped table (its path and "
                         "sha256 go into the JSON)")
    ap.add_argument("--triton-quantizers", action="store_true",
                    help="block FP8: the Triton weight and token-tile quantizers and dSwiGLU kernels where the GPU "
                         "default is their Gluon version (the before of that change)")
    a = ap.parse_args()
    if a.rounds < 1 or a.iters < 1:
        ap.error(f"--rounds and --iters must be at least 1, got {a.rounds} and {a.iters}")
    precisions = parse_precisions(a.precision, ap)
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer.py needs a CUDA GPU")
    env = environment()
    if a.triton_quantizers:
        from titan_megamoe.kernels import dgrad_swiglu, quantize

        quantize._TOKEN_TILE_GLUON = dgrad_swiglu._FP8_DSWIGLU_GLUON = None
        quantize._WEIGHT_GLUON = {}
        env["fp8_memory_kernels"] = "triton"
    if a.tile_table:
        from titan_megamoe.kernels import configs

        env["tile_table"] = configs.use_tile_table(a.tile_table)
    path = result_path(a.out, "bench_layer")
    results, not_run = [], []
    start = clock()

    def write():
        with open(path, "w") as f:
            json.dump({"environment": env, "precisions": precisions, "backend": a.backend, "cases": a.cases,
                       "max_seconds": a.max_seconds, "not_run": not_run, "results": results}, f, indent=1)

    for i, name in enumerate(a.cases, 1):
        prefix = f"[bench {i}/{len(a.cases)}] {name}"
        spent = clock() - start
        reason = None
        if a.max_seconds is not None and spent >= a.max_seconds:
            reason = f"not run: --max-seconds {a.max_seconds:g} spent ({spent:.0f} s elapsed before this case)"
            not_run.append(name)
        else:
            need, free = estimate_peak_gib(CASES[name], len(precisions)), free_memory_gib()
            if free is not None and need > free:
                reason = (f"not run: needs ~{need:.0f} GiB by estimate (bench_layer.estimate_peak_gib), "
                          f"{free:.0f} GiB free on the GPU")
        if reason is None:
            print(f"{prefix} T={CASES[name][0]} ...", flush=True)
            try:
                rows = bench_case(name, precisions, a.warmup, a.iters, checkpointing(a), a.rounds, a.backend)
            except torch.cuda.OutOfMemoryError as e:
                reason = f"out of memory: {one_line(e)[:300]}"
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
        if reason is not None:
            rows = [{**case_fields(name, len(precisions)), "precision": p, "skipped": reason} for p in precisions]
        for r in rows:
            print(progress_line(prefix, r), flush=True)
        results += rows
        write()
    write()
    print(f"\nwrote {path}\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  commit {env['commit']}")
    print_table(results)
    failed = [f"{r['case']} {r['precision']}" for r in results if "failed" in r]
    if failed:
        raise SystemExit(f"bench_layer.py: {len(failed)} row(s) failed their correctness check: {', '.join(failed)}")


if __name__ == "__main__":
    main()
