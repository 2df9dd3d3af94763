#!/usr/bin/env python3
"""Per-layer expert-parallel benchmark: TorchTitan 0.2.2's stock EP against mega_moe EP, same weights and tokens.

    torchrun --nproc_per_node 8 scripts/bench_ep.py                          # Qwen3-30B-A3B, 8192 tokens/rank
    torchrun --nproc_per_node 4 scripts/bench_ep.py --preset 235b-a22b --tokens-per-rank 8192 16384
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 scripts/bench_ep.py --device cpu \\
        --shape 32 32 4 2 --tokens-per-rank 16 --iters 2                      # CPU, gloo: timings meaningless

Arms, per case (D H E K, tokens per rank T, routing), built on every rank from the same seed:
  stock  a `torchtitan.models.moe.MoE` whose `experts` got `parallelize_module(experts, ep_mesh,
         ExpertParallel())` on a 1-D mesh named "ep" (what models/llama4/infra/parallelize.py
         apply_moe_ep_tp does with EP and no TP): stock's all-to-all dispatch/combine hooks and grouped GEMMs;
  mega   a deep copy of the same layer swapped by `converter.swap_moe_layers(layer, "bf16", --backend)`,
         TorchTitan's router module kept (`fused_router=False`, bench_layer's `with_stock_router`: the
         expert path alone is compared), then `MegaAwareExpertParallel()` applied the same way: our
         transport (`titan_megamoe.pipeline.ep_dispatch`: all-to-all, or with --transport symm_mem the
         peers' symmetric-memory buffers, `pipeline.symm_transport`) around the fused kernels.
Each rank draws its own T x D tokens and output gradient (seed 1 + rank). Before any timing the mega
output, input gradient and every parameter gradient (this rank's shard for the experts) are compared
with stock's (relative L2, bench_layer's check_against_stock and its 5e-2 gate); a wrong result stops
the run on every rank.

Timing (bench_layer's method and helpers): CUDA events around each call with the device synchronised
after it, median of --iters after --warmup, every measurement visited once per round over --rounds
(`bench_layer.interleaved`), and a barrier before each visit so that all ranks start it together. Only the
synchronised timing: both arms read the all-to-all split sizes on the host in every layer call (stock in
ExpertParallel._token_dispatch, ours in ep_dispatch.route), so the host cannot queue work beyond the
layer. Aggregates over ranks: time = max (the layer is done when its slowest rank is); TFLOP/s per GPU =
moe_flops(T, K, D, H) / that time (fwd 6*T*K*D*H, fwd+bwd 18*T*K*D*H, T = tokens per rank).

Traffic, counted from this rank's routing (`ep_dispatch.route` on the stock router's ids, so exactly the
rows both arms move): a row to or from another rank is one transfer of its bytes; rows a rank sends to
itself are a local copy inside the all-to-all and are not counted. Per rank and direction (sent, received):
  mega   forward: the counts (EP int64, all-gathered: to and from every peer), x rows (D bf16), ids (int64), scores (fp32), y rows
         back (D bf16); backward: dout rows (D bf16), dx rows back (D bf16), d scores back (fp32)
  stock  forward: tokens per local expert (E/EP int64 per peer), x rows, y rows back; backward: the
         y-row gradients (D bf16), the x-row gradients back (D bf16); scores and ids never travel
Transport bandwidth: a separate microbenchmark times the mega transport's own calls alone (same routing,
same rows): `route` (sort, counts all-gather, the host sync), the x-row dispatch, the ids+scores dispatch
and the y-row combine (`ep_dispatch.exchange`). GB/s per rank = off-rank bytes sent (egress) / time, and
received (ingress) / time; aggregated = mean off-rank bytes per rank / max time over ranks. The backward's
dout and dx exchanges are the same sizes as x and y.

`--transport symm_mem` runs mega's layer with the symmetric-memory transport (rows written into the
peers' torch symmetric-memory buffers; GEMM1 and dgrad wait per expert for the landing rows, GEMM2 and
dx's GEMM store their rows straight into the tokens' ranks; on CPU: shared-memory files and gloo
barriers, a test stand-in), and its transport calls as standalone exchanges (scatter kernel, flags,
copy-out; the layer hides part of that behind its GEMMs, which the layer timings show). The ids do not
travel there (the rows land sorted by expert): their bytes count 0. NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set here before the
process group starts when they are unset (NVLink multicast off: on shared hosts a program that uses it
can take the GPUs out of service); any other value stops the run. With --device cpu the ranks use gloo,
the timings are host wall clock and mean nothing (the table says so), and backend "triton" runs the
kernels in Triton's interpreter (TRITON_INTERPRET=1 is set here if unset; "reference" needs nothing).

Rank 0 writes JSON (device, world size, versions, commit, date, argv, every rank's samples, splits,
bytes and errors) to --out/bench_ep_<UTC stamp>.json and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

# titan_megamoe, and bench_layer which imports it, are imported inside the functions below, after
# configure_process() has set the environment: Triton picks interpreter mode when a kernel is defined
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PRESETS = {"30b-a3b": (2048, 768, 128, 8), "235b-a22b": (4096, 1536, 128, 8)}  # D H E K
TRANSPORTS = ("all_to_all", "symm_mem")  # validation.EP_TRANSPORTS (not imported here: see above)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
MAX_REL_L2 = 5e-2  # bench_layer's gate: bf16 arms with different rounding points differ at ~1e-3
BF16_BYTES, FP32_BYTES, INT64_BYTES = 2, 4, 8


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=list(PRESETS), default="30b-a3b", help="D H E K of a model")
    ap.add_argument("--shape", nargs=4, type=int, metavar=("D", "H", "E", "K"), help="overrides --preset")
    ap.add_argument("--tokens-per-rank", nargs="+", type=int, default=[8192])
    ap.add_argument("--routing", nargs="+", choices=["softmax", "skewed"], default=["softmax"])
    ap.add_argument("--transport", choices=TRANSPORTS, default="all_to_all")
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="with --transport symm_mem: the mega layer runs without the host sync, buffers for this "
                         "factor x the rows a rank routes (`ep_capacity_factor`); the transport calls stay exact")
    ap.add_argument("--backend", choices=["triton", "reference"], default="triton", help="the mega arm's")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleave the measurements: each round times every one once, --iters split over the rounds")
    ap.add_argument("--out", default="docs/results", help="directory for the JSON file (rank 0 writes it)")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.iters < 1:
        ap.error(f"--rounds and --iters must be at least 1, got {a.rounds} and {a.iters}")
    if a.capacity_factor is not None and (a.transport != "symm_mem" or a.capacity_factor < 1):
        ap.error("--capacity-factor needs --transport symm_mem and a value >= 1")
    if a.transport == "symm_mem" and a.backend == "reference":
        ap.error("--transport symm_mem runs the Triton backend (the reference backend moves rows by all-to-all); "
                 "use --backend triton")
    a.D, a.H, a.E, a.K = a.shape or PRESETS[a.preset]
    a.shape_name = "x".join(map(str, a.shape)) if a.shape else a.preset
    return a


def configure_process(a) -> None:
    """Environment the process group and the kernels read at start: multicast off, the CPU interpreter."""
    for name, value in MULTICAST_OFF.items():
        got = os.environ.setdefault(name, value)
        if got != value:
            raise SystemExit(f"bench_ep.py: {name}={got}; it must be {value} (NVLink multicast stays off)")
    if a.device == "cpu" and a.backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_ep.py: no CUDA device; use --device cpu (gloo, timings meaningless)")


def init_ep_mesh(a):
    """The process group (NCCL on GPUs, gloo on CPU) and the 1-D EP mesh over all ranks, named "ep" as
    TorchTitan names it (stock GroupedExperts checks the name to skip its own padding under EP)."""
    from torch.distributed.device_mesh import init_device_mesh

    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from titan_megamoe.integrations.torchtitan import cpu

        cpu.apply()  # stock's router histc and EP padding indices on CPU tensors (no numerics change)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    ep = dist.get_world_size()
    if a.E % ep:
        raise SystemExit(f"bench_ep.py: E={a.E} experts do not split over {ep} ranks")
    return init_device_mesh(a.device, (ep,), mesh_dim_names=("ep",))


def barrier(a) -> None:
    if a.device == "cuda":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def build_ep_arms(a, T, routing, mesh):
    """(stock EP layer, mega EP layer) on identical weights: bench_layer's layers, then each `experts`
    parallelized as apply_moe_ep_tp does."""
    import bench_layer
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    from titan_megamoe.integrations.torchtitan.expert_parallel import MegaAwareExpertParallel

    stock, fused, _ = bench_layer.build_layers(T, a.D, a.H, a.E, a.K, routing, seed=0, backend=a.backend)
    mega = bench_layer.with_stock_router(fused)
    del fused
    parallelize_module(stock.experts, mesh, ExpertParallel())
    parallelize_module(mega.experts, mesh, MegaAwareExpertParallel())
    mega.experts.ep_transport = a.transport
    mega.experts.ep_capacity_factor = a.capacity_factor
    return stock, mega


def rank_tokens(T, D, rank, device):
    """This rank's tokens x [1, T, D] and output gradient, from its own seed."""
    torch.manual_seed(1 + rank)
    x = torch.randn(1, T, D, device=device, dtype=torch.bfloat16)
    return x, torch.randn_like(x)


def all_ranks(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def check_mega_against_stock(stock, mega, x, dout, case_name):
    """Relative L2 of this rank's output and gradients; every rank stops if any rank is off."""
    import bench_layer

    rel = bench_layer.check_against_stock(stock, mega, x, dout)
    every = all_ranks(rel)
    worst = max(max(r.values()) for r in every)
    if worst > MAX_REL_L2:
        raise SystemExit(f"{case_name}: mega EP differs from stock EP (relative L2 per rank {every}); "
                         f"not timing a wrong result")
    return rel


def off_rank_rows(r, rank):
    """(rows this rank sends to other ranks, rows it receives from other ranks) in one dispatch."""
    return sum(r.send_splits) - r.send_splits[rank], sum(r.recv_splits) - r.recv_splits[rank]


def traffic_bytes(r, rank, ep, D, E_local, transport="all_to_all"):
    """Bytes this rank sends and receives over its links per layer, by transfer, for each arm.

    Each transfer is (rows sent, rows received, bytes per row); the combine and the backward's dx go the
    other way, so their sent/received swap. Under symm_mem the ids do not travel (the rows land sorted by
    expert, so the receiver knows each row's expert from the counts): 0 bytes."""
    out_rows, in_rows = off_rank_rows(r, rank)
    row = D * BF16_BYTES
    dispatch = lambda per_row: (out_rows, in_rows, per_row)  # noqa: E731
    back = lambda per_row: (in_rows, out_rows, per_row)  # noqa: E731
    transfers = {
        "mega_fwd": {"split_sizes": (ep - 1, ep - 1, ep * INT64_BYTES), "x": dispatch(row),
                     "ids": dispatch(INT64_BYTES if transport == "all_to_all" else 0), "scores": dispatch(FP32_BYTES),
                     "y": back(row)},
        "mega_bwd": {"dout": dispatch(row), "dx": back(row), "dscores": back(FP32_BYTES)},
        "stock_fwd": {"tokens_per_expert": (ep - 1, ep - 1, E_local * INT64_BYTES), "x": dispatch(row),
                      "y": back(row)},
        "stock_bwd": {"dy": dispatch(row), "dx": back(row)},
    }
    by_transfer = {phase: {name: {"sent": s * b, "received": rv * b} for name, (s, rv, b) in t.items()}
                   for phase, t in transfers.items()}
    totals = {}
    for arm in ("mega", "stock"):
        fwd = by_transfer[f"{arm}_fwd"].values()
        bwd = by_transfer[f"{arm}_bwd"].values()
        for way in ("sent", "received"):
            totals[f"{arm}_fwd_{way}"] = sum(t[way] for t in fwd)
            totals[f"{arm}_fwdbwd_{way}"] = totals[f"{arm}_fwd_{way}"] + sum(t[way] for t in bwd)
    return {"rows_sent_off_rank": out_rows, "rows_received_off_rank": in_rows, "by_transfer": by_transfer,
            **totals}


def transport_calls(ids_TK, x_TD, r, E_local, group, transport, capacity_factor=None):
    """The mega transport's calls on this case's routing, each alone, with their rows prepared outside
    (`route` as the layer runs it: without the host sync under a capacity factor; the exchanges on the
    exact route)."""
    from titan_megamoe.pipeline import ep_dispatch

    K = ids_TK.shape[1]
    x_send_ND = x_TD[r.send_order_N // K]
    ids_send_N = ids_TK.reshape(-1)[r.send_order_N]
    scores_send_N = torch.rand(ids_send_N.shape, device=x_TD.device)
    y_recv_RD = torch.randn(r.num_received, x_TD.shape[1], device=x_TD.device, dtype=x_TD.dtype)
    # what the layer sends besides x: ids and scores under the all-to-all, the scores alone under symm_mem
    # (`ep_dispatch.received_plan`)
    ids_and_scores = (lambda: (ep_dispatch.exchange(ids_send_N, r), ep_dispatch.exchange(scores_send_N, r))) \
        if transport == "all_to_all" else (lambda: ep_dispatch.exchange(scores_send_N, r))
    return {
        "route": lambda: ep_dispatch.route(ids_TK, E_local, group, transport, capacity_factor),
        "dispatch_x": lambda: ep_dispatch.exchange(x_send_ND, r),
        "dispatch_ids_scores": ids_and_scores,
        "combine_y": lambda: ep_dispatch.exchange(y_recv_RD, r, back=True),
    }


def transport_call_bytes(traffic):
    """Off-rank (sent, received) bytes of each timed transport call."""
    t = traffic["by_transfer"]["mega_fwd"]
    pair = lambda *names: tuple(sum(t[n][way] for n in names) for way in ("sent", "received"))  # noqa: E731
    return {"route": pair("split_sizes"), "dispatch_x": pair("x"), "dispatch_ids_scores": pair("ids", "scores"),
            "combine_y": pair("y")}


def measurements(a, stock, mega, x, dout, transport):
    """{key: (fn, timer)} for bench_layer.interleaved: both layers' fwd and fwd+bwd, the transport calls."""
    import bench_layer

    def after_barrier(fn, warmup, iters):
        barrier(a)
        return bench_layer.time_ms(fn, warmup, iters)

    x_req = x.detach().requires_grad_(True)
    m = {}
    for arm, layer in (("stock", stock), ("mega", mega)):
        m[f"{arm}_fwd"] = (functools.partial(layer, x_req), after_barrier)  # training-mode forward
        m[f"{arm}_fwdbwd"] = (functools.partial(bench_layer.run_fwd_bwd, layer, x, dout), after_barrier)
    m.update({f"transport_{name}": (fn, after_barrier) for name, fn in transport.items()})
    return m


def peak_memory(a, stock, mega, x, dout):
    if a.device != "cuda":
        return {}
    import bench_layer

    return {f"{arm}_fwdbwd_peak_gib": bench_layer.peak_mem_gib(functools.partial(bench_layer.run_fwd_bwd, layer, x, dout),
                                                               layer)
            for arm, layer in (("stock", stock), ("mega", mega))}


def bench_rank(a, T, routing, mesh, case_name):
    """This rank's part of one case: check, routing, traffic, timings."""
    import bench_layer
    from titan_megamoe.pipeline import ep_dispatch

    group, rank, ep = mesh.get_group(), dist.get_rank(), dist.get_world_size()
    E_local = a.E // ep
    stock, mega = build_ep_arms(a, T, routing, mesh)
    x, dout = rank_tokens(T, a.D, rank, a.device)
    rel = check_mega_against_stock(stock, mega, x, dout, case_name)
    x_TD = x.view(-1, a.D)
    with torch.no_grad():
        ids_TK = stock.router(x_TD, stock.expert_bias)[1]  # the rows both arms move
    r = ep_dispatch.route(ids_TK, E_local, group, a.transport)
    traffic = traffic_bytes(r, rank, ep, a.D, E_local, a.transport)
    timed = measurements(a, stock, mega, x, dout, transport_calls(ids_TK, x_TD, r, E_local, group, a.transport,
                                                                         a.capacity_factor))
    samples = bench_layer.interleaved(timed, a.warmup, a.iters, a.rounds)
    return {"rank": rank, "rel_l2_vs_stock": rel, "send_splits": r.send_splits, "recv_splits": r.recv_splits,
            "traffic_bytes": traffic,
            "ms": {k: statistics.median(v) for k, v in samples.items()}, "samples_ms": samples,
            **peak_memory(a, stock, mega, x, dout)}


def aggregate(a, T, routing, ep, case_name, ranks):
    """One case over all ranks: max time, TFLOP/s per GPU, bytes, transport GB/s."""
    from titan_megamoe.flops import moe_flops

    res = {"case": case_name, "tokens_per_rank": T, "D": a.D, "H": a.H, "E": a.E, "K": a.K, "routing": routing,
           "ep": ep, "transport": a.transport, "capacity_factor": a.capacity_factor, "mega_backend": a.backend,
           "rounds": a.rounds, "ranks": ranks}
    flops = {"fwd": moe_flops(T, a.K, a.D, a.H, backward=False), "fwdbwd": moe_flops(T, a.K, a.D, a.H)}
    for arm in ("stock", "mega"):
        for kind, fl in flops.items():
            key = f"{arm}_{kind}"
            ms = max(r["ms"][key] for r in ranks)
            res[f"{key}_ms"] = ms
            res[f"{key}_ms_per_rank"] = [r["ms"][key] for r in ranks]
            res[f"{key}_tflops_per_gpu"] = fl / (ms * 1e-3) / 1e12
            for way in ("sent", "received"):
                per_rank = [r["traffic_bytes"][f"{key}_{way}"] for r in ranks]
                res[f"{key}_bytes_{way}_per_rank"] = per_rank
                res[f"{key}_bytes_{way}_max"] = max(per_rank)
    for kind in flops:
        res[f"{kind}_speedup"] = res[f"stock_{kind}_ms"] / res[f"mega_{kind}_ms"]
    res["transport_calls"] = transport_bandwidth(ranks)
    return res


def transport_bandwidth(ranks):
    """Per call: max time over ranks, per-rank egress/ingress GB/s, mean egress per GPU over the max time."""
    out = {}
    for name in ("route", "dispatch_x", "dispatch_ids_scores", "combine_y"):
        ms = [r["ms"][f"transport_{name}"] for r in ranks]
        sent_recv = [transport_call_bytes(r["traffic_bytes"])[name] for r in ranks]
        gbps = lambda b, t: b / (t * 1e-3) / 1e9  # noqa: E731
        out[name] = {"ms_max": max(ms), "ms_per_rank": ms,
                     "bytes_sent_per_rank": [s for s, _ in sent_recv],
                     "bytes_received_per_rank": [rv for _, rv in sent_recv],
                     "egress_gbps_per_rank": [gbps(s, t) for (s, _), t in zip(sent_recv, ms)],
                     "ingress_gbps_per_rank": [gbps(rv, t) for (_, rv), t in zip(sent_recv, ms)],
                     "gbps_per_gpu": gbps(statistics.mean(s for s, _ in sent_recv), max(ms))}
    return out


def write_json(a, env, results):
    os.makedirs(a.out, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = os.path.join(a.out, f"bench_ep_{stamp}.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "results": results}, f, indent=1)
    return path


def fmt_bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def print_table(a, env, results, path):
    print(f"\nwrote {path}\n{env['gpu']} x {env['world_size']}  transport {a.transport}  torch {env['torch']}  "
          f"triton {env['triton']}  commit {env['commit']}")
    if a.device == "cpu":
        print("CPU run (gloo, host clock, tiny shapes): the timings, TFLOP/s and GB/s below are MEANINGLESS")
    print("time: max over ranks; TF/s per GPU; bytes: off-rank, sent / received, max over ranks")
    print(f"{'case':<28}{'arm':<7}{'fwd ms':>9}{'TF/s':>7}{'f+b ms':>9}{'TF/s':>7}  {'fwd bytes':<24}fwd+bwd bytes")
    for r in results:
        for arm in ("stock", "mega"):
            fwd = f"{fmt_bytes(r[f'{arm}_fwd_bytes_sent_max'])} / {fmt_bytes(r[f'{arm}_fwd_bytes_received_max'])}"
            fb = f"{fmt_bytes(r[f'{arm}_fwdbwd_bytes_sent_max'])} / {fmt_bytes(r[f'{arm}_fwdbwd_bytes_received_max'])}"
            print(f"{r['case'] if arm == 'stock' else '':<28}{arm:<7}{r[f'{arm}_fwd_ms']:>9.3f}"
                  f"{r[f'{arm}_fwd_tflops_per_gpu']:>7.0f}{r[f'{arm}_fwdbwd_ms']:>9.3f}"
                  f"{r[f'{arm}_fwdbwd_tflops_per_gpu']:>7.0f}  {fwd:<24}{fb}")
        print(f"{'':<28}speedup fwd {r['fwd_speedup']:.2f}x, fwd+bwd {r['fwdbwd_speedup']:.2f}x; fwd ms per rank "
              f"stock {fmt_list(r['stock_fwd_ms_per_rank'])} mega {fmt_list(r['mega_fwd_ms_per_rank'])}")
        calls = ", ".join(f"{name} {c['ms_max']:.3f} ms {c['gbps_per_gpu']:.1f} GB/s"
                          for name, c in r["transport_calls"].items())
        print(f"{'':<28}mega transport alone: {calls}")


def fmt_list(values):
    return "[" + " ".join(f"{v:.3f}" for v in values) + "]"


def main(argv=None):
    a = parse_args(argv)
    configure_process(a)
    import bench_layer

    bench_layer.DEVICE = a.device  # bench_layer builds its layers and picks its clock by this
    mesh = init_ep_mesh(a)
    rank, ep = dist.get_rank(), dist.get_world_size()
    results = []
    for T in a.tokens_per_rank:
        for routing in a.routing:
            case_name = f"{a.shape_name}-{T}-{routing}"
            if rank == 0:
                print(f"[bench_ep] EP {ep} {case_name} ...", flush=True)
            ranks = all_ranks(bench_rank(a, T, routing, mesh, case_name))
            results.append(aggregate(a, T, routing, ep, case_name, ranks))
            if a.device == "cuda":
                torch.cuda.empty_cache()  # the next case builds its layers anew
    if rank == 0:
        device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (gloo)"
        env = {**bench_layer.environment(device_name), "world_size": ep, "device": a.device,
               "transport": a.transport, "mega_backend": a.backend,
               "multicast_env": {k: os.environ.get(k) for k in MULTICAST_OFF}}
        path = write_json(a, env, results)
        print_table(a, env, results, path)
    dist.destroy_process_group()
    if a.device == "cpu":
        from titan_megamoe.integrations.torchtitan.cpu import exit_skipping_teardown

        exit_skipping_teardown()


if __name__ == "__main__":
    main()
