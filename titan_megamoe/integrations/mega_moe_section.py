"""The `[mega_moe]` config section: its fields, defaults and checks, without TorchTitan.

TorchTitan's config module (`integrations/torchtitan/config.py`) merges `MegaMoE` into its JobConfig; the
launcher (`titan-megamoe train`) and `titan-megamoe ab` check a TOML's section and overrides with
`check_job_section` (the values, and with `enable` what this machine can run) before any process starts,
so this module must not import TorchTitan (importing it costs a launch ~4 s).

Every `[mega_moe]` value is checked when the section is built (`MegaMoE.__post_init__`), from the TOML or
the command line, enabled or not: TorchTitan's parser would keep `enable = "false"` as a (truthy) string
and any `backend` string.

No `from __future__ import annotations` here: ConfigManager merges sections by checking
`dataclasses.is_dataclass(field.type)`, which needs real types, not strings.
"""

import difflib
import os
from dataclasses import dataclass, fields

from ..precision import Precision
from ..validation import BACKENDS
from ..validation import EP_TRANSPORTS as _TRANSPORTS

EP_TRANSPORTS = ("auto", *_TRANSPORTS)
# the str keys' allowed values
CHOICES = {"precision": tuple(p.value for p in Precision), "backend": BACKENDS, "ep_transport": EP_TRANSPORTS}


class MegaMoEConfigError(ValueError):
    """A bad `[mega_moe]` key or value; the message names it and the fix."""


@dataclass
class MegaMoE:
    enable: bool = False
    """Run every MoE layer's routed experts through titan-megamoe's fused op (same parameters, FQNs and checkpoints as stock)."""

    precision: str = "bf16"
    """bf16 | fp8 | fp8_bwd | mxfp8. bf16, fp8 (Hopper block FP8, forward and backward) and fp8_bwd (bf16 forward, FP8 backward) on both backends (reference: the pure-PyTorch emulation); FP8 needs D and H multiples of 128, and the Triton backend under expert parallelism. mxfp8: Blackwell only."""

    backend: str = "auto"
    """auto | triton | reference. auto: the fused Triton kernels on CUDA, the pure-PyTorch reference (stock's rounding) elsewhere."""

    fused_router: bool = True
    """With the Triton backend: the router's softmax/sigmoid, expert bias, top-k and normalisation in one kernel (same math as stock; ties to the lowest expert id). false = TorchTitan's router module."""

    save_under_sac: bool = False
    """Under op-level SAC: false = the fused op is recomputed in backward like stock's grouped GEMMs; true = its outputs are saved."""

    ep_transport: str = "auto"
    """With parallelism.expert_parallel_degree > 1: how token rows move between EP ranks. all_to_all = torch.distributed all-to-all (NCCL, gloo on CPU); symm_mem = a Triton kernel writes the rows into the peers' torch symmetric-memory buffers, sorted by expert; GEMM1 (and dgrad in the backward) start on each expert once its rows have landed, and GEMM2 (dx's GEMM) store their rows straight into the tokens' ranks (Triton backend; not measured on GPUs); auto = all_to_all."""

    ep_capacity_factor: float = 0.0
    """With ep_transport = symm_mem: 0 = buffers sized from the expert counts read on the host (one host sync per MoE layer, as stock EP); a number >= 1 = no host sync: each rank's buffers hold that many times the rows it routes (tokens x top-k; every rank must route as many), and a device-side check stops the step, dropping nothing, if a rank would receive more. EP x min(top-k, local experts) / top-k holds any routing."""

    tile_table: str = ""
    """A tile-config table from `titan-megamoe tune --out FILE` for this model's shape (every rank reads the same file); empty = the shipped table and defaults."""

    def __post_init__(self):
        for f in fields(self):
            check_value(f.name, getattr(self, f.name))


def _toml(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else f'"{value}"'


def check_value(key: str, value) -> None:
    """Raise MegaMoEConfigError unless `value` has the type (and, for strings, one of the values) of `key`."""
    kind = {f.name: f.type for f in fields(MegaMoE)}[key]
    if key == "tile_table":  # a path: any string (the converter loads and checks the file)
        if not isinstance(value, str):
            raise MegaMoEConfigError(f"[mega_moe] tile_table must be a file path string, got "
                                     f"{type(value).__name__} {value!r}; e.g. tile_table = \"tile_table.json\"")
        return
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value == 0 or value >= 1):
            raise MegaMoEConfigError(f"[mega_moe] {key} must be 0 or a number >= 1, got {type(value).__name__} "
                                     f"{value!r}; e.g. {key} = 1.5 (unquoted in TOML)")
        return
    if kind is bool:
        if not isinstance(value, bool):
            raise MegaMoEConfigError(f"[mega_moe] {key} must be a bool, got {type(value).__name__} {value!r}; "
                                     f"write {key} = true or {key} = false (unquoted in TOML)")
        return
    allowed = CHOICES[key]
    if not isinstance(value, str) or value not in allowed:
        shown = f"{type(value).__name__} {value!r}" if not isinstance(value, str) else repr(value)
        raise MegaMoEConfigError(f"[mega_moe] {key} must be one of {', '.join(map(_toml, allowed))}, got {shown}; "
                                 f"e.g. {key} = {_toml(getattr(MegaMoE, key))}")


def bool_keys() -> list[str]:
    """The section's bool keys (flags on TorchTitan's command line)."""
    return [f.name for f in fields(MegaMoE) if f.type is bool]


def device_for_checks():
    """The device a job's checks are made for: this rank's GPU (LOCAL_RANK, 0 in the launcher), else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_tile_table(path: str) -> str:
    """Make the kernels use the `titan-megamoe tune` table at `path` (`kernels.configs.use_tile_table`, which checks
    every entry); its description for logs. A table that does not load is a MegaMoEConfigError."""
    from ..kernels.configs import use_tile_table

    try:
        return use_tile_table(path)
    except ValueError as e:
        raise MegaMoEConfigError(f"[mega_moe] tile_table: {e}") from None


def check_precision_backend(precision: str, backend: str, device):
    """(recipe, resolved backend) of a job's `[mega_moe]` precision and backend on `device` (the job's GPU, or
    the CPU); MegaMoEConfigError naming the key and the fix for what that device cannot run. `auto` is checked
    as the Triton backend, so it takes the kernels' precisions only (on a CPU it then runs the reference backend,
    for fp8 the emulation). The converter checks it in every rank, the launchers (`check_job_section`) once
    before any process starts."""
    from ..ops import resolve_backend  # torch and the kernels' host code: not needed by check_section
    from ..precision import check_backend_precision, recipe_for

    try:
        recipe = recipe_for(precision, device)
    except (ValueError, NotImplementedError) as e:  # the API's own fix ("; use precision=...") in job form
        raise MegaMoEConfigError(f"[mega_moe] {str(e).split('; use ', 1)[0]}; set --mega_moe.precision bf16") from None
    try:
        resolved = resolve_backend(backend, device)
    except ValueError as e:
        if backend != "triton":
            raise MegaMoEConfigError(f"[mega_moe] {e}") from None
        raise MegaMoEConfigError(
            f"[mega_moe] backend = \"triton\" needs a CUDA GPU and this job's device is {device}; set "
            f"--mega_moe.backend auto (the fused kernels on a GPU, the reference backend elsewhere), or set "
            f"TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter (small models only)") from None
    try:
        check_backend_precision(recipe, "triton" if backend == "auto" else resolved, device)
    except NotImplementedError as e:
        raise MegaMoEConfigError(f"[mega_moe] {e} (set --mega_moe.precision bf16, or --mega_moe.backend "
                                 f"reference for the emulation)") from None
    except ValueError as e:  # block FP8 on a GPU without FP8 tensor cores: the message names the fix
        raise MegaMoEConfigError(f"[mega_moe] {e}") from None
    return recipe, resolved


def check_job_section(table: dict, enabled: bool | None = None) -> None:
    """What `titan-megamoe train` and `ab` check before any process starts: `check_section`, then, when the
    section is enabled (`enabled`, else its `enable` key), what this machine cannot run: the precision and
    backend on its device (its first GPU, or the CPU), and the `tile_table` file (every rank loads it). One line
    instead of a traceback per rank, and in `ab` before the other arm has trained."""
    check_section(table)
    if not (table.get("enable", False) if enabled is None else enabled):
        return
    check_precision_backend(table.get("precision", MegaMoE.precision), table.get("backend", MegaMoE.backend),
                            device_for_checks())
    if table.get("tile_table"):  # loaded and checked entry by entry as the converter will, then dropped again
        from ..kernels.configs import use_tile_table

        try:
            load_tile_table(table["tile_table"])
        finally:
            use_tile_table(None)


def check_section(table: dict) -> None:
    """Check a `[mega_moe]` table as written in a TOML (or built from overrides): keys, then values."""
    valid = [f.name for f in fields(MegaMoE)]
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise MegaMoEConfigError(f"[mega_moe] unknown key {key!r}{hint}; valid keys: {', '.join(valid)}")
    for key, value in table.items():
        check_value(key, value)
