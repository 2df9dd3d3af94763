"""Minimal patches that let TorchTitan 0.2.2's trainer run on a CPU-only host (demo, tests, CI).

`apply()` is called by the `titan-megamoe train` entry point only when no CUDA device exists, before
the trainer starts. Each patch targets one thing that fails on CPU and leaves every other path as it
was; none changes numerics:

1. Device type. `torchtitan.tools.utils` computes `device_type = _get_available_device_type() or
   "cuda"` at import, so on a CPU host the trainer calls `torch.cuda.set_device` and fails. We make
   `torch._utils._get_available_device_type` answer "cpu" instead of None and set "cpu" (and the
   device module of item 2) in the TorchTitan modules that copy them at import, whichever was
   imported first. torch.distributed then picks gloo for "cpu".
2. Device module. TorchTitan calls `get_device_name`, `get_device_properties`, `memory_stats`,
   `reset_peak_memory_stats` and `empty_cache` (metrics' DeviceMemoryMonitor) on its device module;
   `torch.cpu` has none of them, and its `current_device()` returns "cpu" where
   `torch.distributed.barrier(device_ids=[...])` needs an int. TorchTitan's modules get a thin view
   of `torch.cpu` that adds these (no-op memory stats: peak memory reads 0 GiB; capacity is the
   host's RAM; device index 0). `torch.cpu` itself is not modified.
3. FSDP2 gradient reduction. FSDP2 reduce-scatters with AVG or PREMUL_SUM, which gloo lacks; on CPU
   we set FSDP's own `force_sum_reduction_for_comms` path (SUM, then divide by the same factor).
4. `torch.histc` on integer CPU tensors. The stock router counts tokens per expert with
   `torch.histc(int64 ids)`, which CUDA supports and CPU does not ("histogram_cpu" not implemented for
   'Long'). For integer CPU inputs only, we count in float32 (exact below 2**24) and return the
   input's dtype, as CUDA does.
5. MoE padding indices. With `use_grouped_mm` the stock experts pad each expert's rows with
   `generate_permute_indices`, a Triton kernel that cannot take CPU tensors; TorchTitan ships a CPU
   implementation (`use_cpu=True`) that we select when the counts live on the CPU.
"""

from __future__ import annotations

import functools
import importlib
import os
import types

import torch

_APPLIED = False

# modules that copy `device_type` / `device_module` out of torchtitan.tools.utils at import
_DEVICE_GLOBAL_HOLDERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiling",
)


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Apply all CPU patches (idempotent). Call before the Trainer is constructed."""
    global _APPLIED
    if _APPLIED:
        return
    _patch_device_type()
    _patch_fsdp_sum_reduction()
    _patch_histc_int_cpu()
    _patch_permute_indices_cpu()
    _APPLIED = True


def exit_skipping_teardown() -> None:
    """End a process that finished its gloo work without Python's interpreter teardown: with torch 2.13
    on CPU, several gloo processes of ours (trainer arms, EP workers, bench_ep ranks) that had completed
    and destroyed their process group then aborted at exit in about half the runs ("terminate called
    without an active exception", exit code -6), which made a finished run look failed. Output is
    flushed first; only the success path calls this, so a failure still exits with its traceback."""
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


class _CpuDeviceModule(types.ModuleType):
    """`torch.cpu` plus the device-module calls TorchTitan makes that torch.cpu lacks."""

    def __init__(self):
        super().__init__("titan_megamoe_cpu_device_module")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(name="CPU", total_memory=_ram_bytes())

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


CPU_DEVICE_MODULE = _CpuDeviceModule()


def _patch_device_type() -> None:
    import torch._utils as tu

    original = tu._get_available_device_type
    if not getattr(original, "_titan_megamoe_cpu", False):

        @functools.wraps(original)
        def _get_available_device_type():
            return original() or "cpu"

        _get_available_device_type._titan_megamoe_cpu = True
        tu._get_available_device_type = _get_available_device_type

    for name in _DEVICE_GLOBAL_HOLDERS:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = CPU_DEVICE_MODULE


def _patch_fsdp_sum_reduction() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    original = coll._get_gradient_divide_factors
    if getattr(original, "_titan_megamoe_cpu", False):
        return

    @functools.wraps(original)
    def _get_gradient_divide_factors(rs_group, ar_group, reduce_dtype, device_type="", factor=None,
                                     force_sum_reduction_for_comms=False):
        if device_type == "cpu":
            force_sum_reduction_for_comms = True  # gloo has no AVG / PREMUL_SUM
        return original(rs_group, ar_group, reduce_dtype, device_type, factor, force_sum_reduction_for_comms)

    _get_gradient_divide_factors._titan_megamoe_cpu = True
    coll._get_gradient_divide_factors = _get_gradient_divide_factors


def histc_int_cpu(original):
    """Wrap torch.histc so integer CPU inputs are counted in float32 (patch 4)."""

    @functools.wraps(original)
    def histc(input, *args, **kwargs):
        if isinstance(input, torch.Tensor) and input.device.type == "cpu" and not input.is_floating_point():
            return original(input.float(), *args, **kwargs).to(input.dtype)
        return original(input, *args, **kwargs)

    histc._titan_megamoe_cpu = True
    return histc


def permute_indices_cpu(original):
    """Wrap TorchTitan's generate_permute_indices to use its CPU implementation for CPU tensors (patch 5)."""

    @functools.wraps(original)
    def generate_permute_indices(tokens_per_expert_group, *args, **kwargs):
        if tokens_per_expert_group.device.type == "cpu":
            kwargs["use_cpu"] = True
        return original(tokens_per_expert_group, *args, **kwargs)

    generate_permute_indices._titan_megamoe_cpu = True
    return generate_permute_indices


def _patch_histc_int_cpu() -> None:
    if not getattr(torch.histc, "_titan_megamoe_cpu", False):
        torch.histc = histc_int_cpu(torch.histc)


def _patch_permute_indices_cpu() -> None:
    from torchtitan.models.moe import utils as moe_utils

    if not getattr(moe_utils.generate_permute_indices, "_titan_megamoe_cpu", False):
        moe_utils.generate_permute_indices = permute_indices_cpu(moe_utils.generate_permute_indices)
