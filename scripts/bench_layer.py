#!/usr/bin/env python3
"""Per-layer benchmark: TorchTitan 0.2.2's stock MoE layer vs the mega_moe layer, same weights and tokens.

For each case it builds one stock `torchtitan.models.moe.MoE` (bf16, on the GPU), a copy swapped to
the fused backend (fused router and expert kernels; a third arm, `fused_stock_router`, keeps
TorchTitan's router module so the experts' share of the gain shows on its own), checks the fused output and every gradient against stock (before timing), then
times forward and forward+backward of both layers in the same process with CUDA events (median of
--iters after --warmup runs, taken in --rounds rounds that each visit every arm, so a slow drift of
the machine does not favour one arm), and records peak memory of forward+backward.

Two timings per measurement, both with CUDA events around each call:
  synchronised   the GPU is idle when each call starts, so the call's host launch latency up to its
                 first long kernel is in the time (an upper bound; a lone layer with nothing queued);
  back-to-back   calls queue behind each other with one synchronisation at the end (the method of
                 triton.testing.do_bench): the host runs ahead as it does in a training step, so the
                 time is the GPU's, plus any gap where the host could not keep up. TFLOP/s use the peers'
convention (fwd 6*T*K*D*H, fwd+bwd 18*T*K*D*H). Writes JSON (GPU, versions, commit, date, every
timing) to --out, and prints a table last.

    python scripts/bench_layer.py                       # all default cases
    python scripts/bench_layer.py --cases 30b-16k --iters 50
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import functools
import json
import os
import statistics
import sys
import time

import torch

from titan_megamoe.flops import moe_flops

DEVICE = "cuda"  # the tests run the whole script on CPU (Triton interpreter) by changing this
# name: (T, D, H, E, K, routing)
CASES = {
    "30b-16k": (16384, 2048, 768, 128, 8, "softmax"),
    "30b-4k": (4096, 2048, 768, 128, 8, "softmax"),
    "235b-16k": (16384, 4096, 1536, 128, 8, "softmax"),
    "30b-16k-skewed": (16384, 2048, 768, 128, 8, "skewed"),
}


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
    if routing == "skewed":
        # expert_bias only changes which experts are chosen: a Zipf-like preference for low ids
        stock.expert_bias.copy_(0.02 / torch.arange(1, E + 1, device=DEVICE).float())
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


def check_against_stock(stock, fused, x, dout):
    """Relative L2 error of fused vs stock for the output and every gradient (both bf16); under EP, of
    this rank's shard of each expert-weight gradient."""
    outs = {}
    for name, layer in (("stock", stock), ("fused", fused)):
        out, dx = run_fwd_bwd(layer, x, dout)
        grads = {n: local(p.grad).float().clone() for n, p in layer.named_parameters()}
        outs[name] = {"out": out.float(), "dx": dx.float(), **grads}
    rel = {}
    for k, ref in outs["stock"].items():
        got = outs["fused"][k]
        assert torch.isfinite(got).all(), f"fused {k} has non-finite values"
        rel[k] = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return rel


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


def sac_fwd_bwd(layer, x, dout, save_ops):
    """forward+backward under op-level selective AC saving `save_ops` (like qwen3's op-SAC)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    x = x.detach().requires_grad_(True)
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    out = checkpoint(layer, x, use_reentrant=False, context_fn=ctx_fn)
    out.backward(dout)


def bench_case(name, warmup, iters, with_sac, rounds=1):
    T, D, H, E, K, routing = CASES[name]
    stock, fused, x = build_layers(T, D, H, E, K, routing)
    dout = torch.randn_like(x)
    rel = check_against_stock(stock, fused, x, dout)
    # both arms are bf16 with different rounding points, so they differ at the 1e-3 level; an order of
    # magnitude more means a broken kernel (the accuracy gate proper is tests/test_gpu_kernels.py)
    worst = max(rel.values())
    if worst > 5e-2:
        raise SystemExit(f"{name}: fused differs from stock (relative L2 {rel}); not timing a wrong kernel")
    with torch.no_grad():
        ids = stock.router(x.view(-1, D), stock.expert_bias)[1]
        counts = torch.bincount(ids.flatten(), minlength=E)
    res = {"case": name, "T": T, "D": D, "H": H, "E": E, "K": K, "routing": routing, "rel_l2_vs_stock": rel,
           "rows_per_expert": {"min": int(counts.min()), "max": int(counts.max()), "mean": float(counts.float().mean())}}
    x_req = x.detach().requires_grad_(True)
    arms = {"stock": stock, "fused": fused, "fused_stock_router": with_stock_router(fused)}
    measurements = {}
    for arm, layer in arms.items():
        fwd = functools.partial(layer, x_req)  # training-mode forward: autograd records residuals
        fb = functools.partial(run_fwd_bwd, layer, x, dout)
        measurements.update({f"{arm}_fwd": (fwd, time_ms), f"{arm}_fwdbwd": (fb, time_ms),
                             f"{arm}_fwd_b2b": (fwd, time_back_to_back_ms),
                             f"{arm}_fwdbwd_b2b": (fb, time_back_to_back_ms)})
    res["rounds"] = rounds
    for key, samples in interleaved(measurements, warmup, iters, rounds).items():
        res[f"{key}_ms"], res[f"{key}_all"] = statistics.median(samples), samples
    for arm, layer in arms.items():
        res[f"{arm}_fwdbwd_peak_gib"] = peak_mem_gib(functools.partial(run_fwd_bwd, layer, x, dout), layer)
    if with_sac:
        from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

        fused_op = torch.ops.titan_megamoe.moe_forward.default
        variants = {"stock_sac": (stock, set(_op_sac_save_list)),
                    "fused_sac_recompute": (fused, set(_op_sac_save_list)),
                    "fused_sac_save": (fused, set(_op_sac_save_list) | {fused_op})}
        for key, (layer, ops) in variants.items():
            fn = functools.partial(sac_fwd_bwd, layer, x, dout, ops)
            res[f"{key}_fwdbwd_ms"], _ = time_ms(fn, warmup, iters)
            res[f"{key}_peak_gib"] = peak_mem_gib(fn, layer)
    for kind, fl in (("fwd", moe_flops(T, K, D, H, backward=False)), ("fwdbwd", moe_flops(T, K, D, H))):
        for arm in ("stock", "fused"):
            res[f"{arm}_{kind}_tflops"] = fl / (res[f"{arm}_{kind}_ms"] * 1e-3) / 1e12
        res[f"{kind}_speedup"] = res[f"stock_{kind}_ms"] / res[f"fused_{kind}_ms"]
        res[f"{kind}_b2b_speedup"] = res[f"stock_{kind}_b2b_ms"] / res[f"fused_{kind}_b2b_ms"]
        res[f"fused_{kind}_b2b_tflops"] = fl / (res[f"fused_{kind}_b2b_ms"] * 1e-3) / 1e12
    del stock, fused
    torch.cuda.empty_cache()
    return res


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleave the arms: each round times every arm once, --iters split over the rounds")
    ap.add_argument("--sac", action="store_true", help="also time op-level selective AC (recompute vs save)")
    ap.add_argument("--out", default="docs/results", help="directory for the JSON file")
    a = ap.parse_args()
    if a.rounds < 1 or a.iters < 1:
        ap.error(f"--rounds and --iters must be at least 1, got {a.rounds} and {a.iters}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer.py needs a CUDA GPU")
    env = environment()
    results = []
    for name in a.cases:
        print(f"[bench] {name} ...", flush=True)
        results.append(bench_case(name, a.warmup, a.iters, a.sac, a.rounds))
        r = results[-1]
        print(f"[bench] {name}: fwd {r['stock_fwd_ms']:.2f} -> {r['fused_fwd_ms']:.2f} ms, "
              f"fwd+bwd {r['stock_fwdbwd_ms']:.2f} -> {r['fused_fwdbwd_ms']:.2f} ms", flush=True)
    os.makedirs(a.out, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = os.path.join(a.out, f"bench_layer_{stamp}.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "results": results}, f, indent=1)
    print(f"\nwrote {path}\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  commit {env['commit']}")
    hdr = f"{'case':<16}{'stock fwd':>10}{'fused fwd':>10}{'x':>6}{'TF/s':>6}{'stock f+b':>10}{'fused f+b':>10}{'x':>6}{'TF/s':>6}{'mem s/f GiB':>14}"
    print(hdr)
    for r in results:
        print(f"{r['case']:<16}{r['stock_fwd_ms']:>10.2f}{r['fused_fwd_ms']:>10.2f}{r['fwd_speedup']:>6.2f}"
              f"{r['fused_fwd_tflops']:>6.0f}{r['stock_fwdbwd_ms']:>10.2f}{r['fused_fwdbwd_ms']:>10.2f}"
              f"{r['fwdbwd_speedup']:>6.2f}{r['fused_fwdbwd_tflops']:>6.0f}"
              f"{r['stock_fwdbwd_peak_gib']:>7.2f}/{r['fused_fwdbwd_peak_gib']:.2f}")
        print(f"{'  back-to-back':<16}{r['stock_fwd_b2b_ms']:>10.2f}{r['fused_fwd_b2b_ms']:>10.2f}"
              f"{r['fwd_b2b_speedup']:>6.2f}{r['fused_fwd_b2b_tflops']:>6.0f}{r['stock_fwdbwd_b2b_ms']:>10.2f}"
              f"{r['fused_fwdbwd_b2b_ms']:>10.2f}{r['fwdbwd_b2b_speedup']:>6.2f}{r['fused_fwdbwd_b2b_tflops']:>6.0f}")
        print(f"{'  stock router':<16}{'':>10}{r['fused_stock_router_fwd_ms']:>10.2f}"
              f"{r['stock_fwd_ms'] / r['fused_stock_router_fwd_ms']:>6.2f}{'':>6}{'':>10}"
              f"{r['fused_stock_router_fwdbwd_ms']:>10.2f}{r['stock_fwdbwd_ms'] / r['fused_stock_router_fwdbwd_ms']:>6.2f}")
        if "stock_sac_fwdbwd_ms" in r:
            print(f"{'  op-SAC':<16} stock {r['stock_sac_fwdbwd_ms']:.2f} ms {r['stock_sac_peak_gib']:.2f} GiB | fused "
                  f"recompute {r['fused_sac_recompute_fwdbwd_ms']:.2f} ms {r['fused_sac_recompute_peak_gib']:.2f} GiB"
                  f" | fused save {r['fused_sac_save_fwdbwd_ms']:.2f} ms {r['fused_sac_save_peak_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
