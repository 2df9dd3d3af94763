"""Find a training config, read it with tomli, apply `--section.key value` overrides, and describe it.

The A/B report needs a few settings before the run (tokens per step, activation checkpointing); these are read
from the TOML plus the overrides, on top of TorchTitan's own defaults. After a run, `settings_from_saved`
reads the JobConfig the trainer itself resolved (`--job.save_config_file`), which is the authority.
"""

from __future__ import annotations

import importlib

import importlib.resources
import json
from pathlib import Path
from typing import Any

import tomli

DEFAULT_CONFIG = "tiny_cpu.toml"


class ConfigError(ValueError):
    pass


def bundled_configs() -> list[str]:
    root = importlib.resources.files("titan_megamoe").joinpath("configs")
    try:
        return sorted(p.name for p in root.iterdir() if p.name.endswith(".toml"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def resolve_config_path(name: str | None) -> Path:
    """A path on disk, else a bundled config name (`qwen3_moe_debug.toml`, `.toml` optional)."""
    name = name or DEFAULT_CONFIG
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve()
    if path.parent == Path("."):
        root = importlib.resources.files("titan_megamoe").joinpath("configs")
        for candidate in (name, f"{name}.toml"):
            bundled = root.joinpath(candidate)
            if bundled.is_file():
                return Path(str(bundled)).resolve()
    available = ", ".join(bundled_configs()) or "none found"
    raise ConfigError(
        f"config {name!r} not found: it is neither a file nor a bundled config (bundled: {available}); "
        f"pass --config PATH/TO/config.toml or a bundled name"
    )


def _coerce(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class FlagValueError(ConfigError):
    """A value given to a bool option: TorchTitan's CLI (tyro) spells bools as flags, `--a.b` / `--a.no-b`."""


# TorchTitan 0.2.2's bool options (JobConfig's bool fields; tests/test_ab_config.py checks the list against it, so
# the launcher need not import TorchTitan to know them) and [mega_moe]'s
TORCHTITAN_BOOL_OPTIONS = frozenset({
    "activation_checkpoint.debug", "activation_checkpoint.early_stop", "activation_checkpoint.preserve_rng_state",
    "activation_checkpoint.visualize_memory_budget_pareto", "checkpoint.create_seed_checkpoint", "checkpoint.enable",
    "checkpoint.enable_first_step_checkpoint", "checkpoint.enable_ft_dataloader_checkpoints",
    "checkpoint.initial_load_in_hf", "checkpoint.initial_load_in_hf_quantized", "checkpoint.initial_load_model_only",
    "checkpoint.last_save_in_hf", "checkpoint.last_save_model_only", "checkpoint.load_only", "compile.enable",
    "debug.deterministic", "debug.deterministic_warn_only", "debug.moe_force_load_balance", "fault_tolerance.enable",
    "job.print_config", "memory_estimation.disable_fake_mode", "memory_estimation.enable",
    "metrics.disable_color_printing", "metrics.enable_tensorboard", "metrics.enable_wandb",
    "metrics.save_for_all_ranks", "model.print_after_conversion", "optimizer.early_step_in_backward",
    "parallelism.disable_loss_parallel", "parallelism.enable_async_tensor_parallel",
    "parallelism.pipeline_parallel_expert_parallel_overlap", "profiling.enable_memory_snapshot",
    "profiling.enable_profiling", "quantize.linear.float8.emulate",
    "quantize.linear.float8.enable_fsdp_float8_all_gather",
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "training.dataloader.persistent_workers",
    "training.dataloader.pin_memory", "training.enable_cpu_offload", "training.gc_debug",
    "validation.dataloader.persistent_workers", "validation.dataloader.pin_memory", "validation.enable",
})


def bool_options() -> frozenset:
    from ..integrations.mega_moe_section import bool_keys

    return TORCHTITAN_BOOL_OPTIONS | {f"mega_moe.{k}" for k in bool_keys()}


def flag_key(arg: str) -> tuple[str, bool]:
    """The dotted key of an override as tyro spells it, and whether it is a negated bool flag:
    `--a.b-c[=v]` -> ("a.b_c", False), `--a.no-b` -> ("a.b", True)."""
    section, dot, leaf = arg[2:].split("=", 1)[0].rpartition(".")
    negated = leaf.startswith(("no-", "no_"))
    return f"{section}{dot}{leaf[3:] if negated else leaf}".replace("-", "_"), negated


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """TorchTitan CLI overrides as (dotted key, value): `--a.b v`, `--a.b=v`, bool flags `--a.b`, `--a.no-b`.
    A value given to a bool option (`--compile.enable true`, `--mega_moe.enable=false`) is a FlagValueError:
    tyro's bools take no value, and its own message for it ("Unrecognized options: false") names neither the
    option nor the spelling."""
    bools = bool_options()
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"override {arg!r}: expected --section.key [value]")
        key, text = arg[2:], None
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            text, i = args[i + 1], i + 2
        else:  # a bool flag, as tyro spells them
            key, negated = flag_key(arg)
            value = not negated
            i += 1
        if text is not None:
            if key.replace("-", "_") in bools:
                section, dot, leaf = key.rpartition(".")
                given = arg if "=" in arg else f"{arg} {text}"
                raise FlagValueError(f"override {given}: TorchTitan's bool options take no value; write "
                                     f"--{key} for true, --{section}{dot}no-{leaf} for false")
            value = _coerce(text)
        out.append((key.replace("-", "_"), value))
    return out


def apply_overrides(values: dict, overrides: list[tuple[str, Any]]) -> dict:
    out = json.loads(json.dumps(values))  # deep copy of plain TOML data
    for key, value in overrides:
        *sections, leaf = key.split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key}: {s!r} is a value, not a section")
        node[leaf] = value
    return out


def load_config(path: Path, overrides: list[str]) -> dict:
    try:
        with open(path, "rb") as f:
            values = tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"config {path}: not valid TOML ({e})") from None
    return apply_overrides(values, parse_overrides(overrides))


def lookup(values: dict, dotted: str, default: Any = None) -> Any:
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _dataclass_default(module: str, dotted: str) -> Any:
    """The default of a JobConfig field in `module` (None if the module or the field is missing)."""
    try:
        job_config = importlib.import_module(module).JobConfig
    except ImportError:
        return None
    node: Any = job_config()
    for part in dotted.split("."):
        node = getattr(node, part, None)
    return node


def _torchtitan_default(dotted: str) -> Any:
    return _dataclass_default("torchtitan.config", dotted)


def _mega_moe_default(dotted: str) -> Any:
    """Our own `[mega_moe]` section's default (its module imports no TorchTitan)."""
    from ..integrations.mega_moe_section import MegaMoE

    return getattr(MegaMoE(), dotted.split(".", 1)[1], None)


def setting(values: dict, dotted: str) -> Any:
    """A config value: the TOML/overrides/saved value, else the default of whoever owns the field."""
    value = lookup(values, dotted)
    if value is not None:
        return value
    return _mega_moe_default(dotted) if dotted.startswith("mega_moe.") else _torchtitan_default(dotted)


# ---------------------------------------------------------------------------------------------------------
# What activation checkpointing saves, in words. Mirrors torchtitan 0.2.2
# `distributed/activation_checkpoint.py` and each model's `_op_sac_save_list`.

_OP_SAC_SAVES = {
    # qwen3, llama3: mm, SDPA variants, reduce_scatter, max (and flex/varlen attention, compiled code)
    "qwen3": "mm (every 2nd; router gate mm recomputed), SDPA, reduce_scatter, max",
    "llama3": "mm (every 2nd), SDPA, reduce_scatter, max",
    # llama4, deepseek_v3, gpt_oss also save all_to_all (EP dispatch/combine)
    "llama4": "mm (every 2nd; router gate mm recomputed), SDPA, reduce_scatter, all_to_all, max",
    "deepseek_v3": "mm (every 2nd; router gate mm recomputed), SDPA, reduce_scatter, all_to_all, max",
    "gpt_oss": "mm (every 2nd; router gate mm recomputed), SDPA, reduce_scatter, all_to_all, max",
}


def describe_ac(mode: str | None, option: Any, model_name: str | None, mega: bool, save_under_sac: Any) -> str:
    """One line: what this arm's activation checkpointing keeps and what it recomputes."""
    moe_op = "fused MoE op" if mega else "grouped_mm"
    mode = (mode or "selective").lower()
    if mode == "none":
        return "no AC: all activations saved, nothing recomputed"
    if mode == "full":
        return f"full AC: every block recomputed in backward (only block inputs saved; {moe_op} recomputed)"
    if mode == "memory_budget":
        return "compiler memory-budget AC (the partitioner chooses what to save)"
    if mode != "selective":
        return f"activation_checkpoint.mode={mode!r}"
    option = str(option if option is not None else "2")
    if option.isdigit():
        n = int(option)
        return (
            f"layer-SAC every {n} layer(s): those blocks recomputed in full ({moe_op} included), "
            f"the others save all activations"
        )
    if option != "op":
        return f"selective AC, selective_ac_option={option!r}"
    family = next((k for k in _OP_SAC_SAVES if (model_name or "qwen3").startswith(k)), "qwen3")
    saves = _OP_SAC_SAVES[family]
    if not mega:
        return f"op-SAC: saves {saves}; grouped_mm recomputed"
    if save_under_sac is None:
        fate = "fused MoE op: mega_moe.save_under_sac not set (see the trainer's default)"
    elif save_under_sac:
        fate = "fused MoE op saved (mega_moe.save_under_sac=true)"
    else:
        fate = "fused MoE op recomputed (mega_moe.save_under_sac=false)"
    return f"op-SAC: saves {saves}; {fate}"


def arm_settings(values: dict, mega: bool) -> dict:
    """The settings the report shows for one arm, from a nested config dict (TOML+overrides or saved)."""
    mode = setting(values, "activation_checkpoint.mode")
    option = setting(values, "activation_checkpoint.selective_ac_option")
    model = setting(values, "model.name")
    save_under_sac = setting(values, "mega_moe.save_under_sac")
    return {
        "model": f"{model} {setting(values, 'model.flavor')}",
        "local_batch_size": setting(values, "training.local_batch_size"),
        "seq_len": setting(values, "training.seq_len"),
        "activation_checkpoint": {"mode": mode, "selective_ac_option": option},
        "mega_moe.save_under_sac": save_under_sac if mega else None,
        "ac_saves": describe_ac(mode, option, model, mega, save_under_sac),
    }


def load_saved(path: Path) -> dict | None:
    """The JobConfig JSON the trainer wrote (`--job.save_config_file`), or None."""
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None
