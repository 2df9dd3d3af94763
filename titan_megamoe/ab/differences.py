"""What each arm ran with, and in what the two arms differ.

An A/B is read as "the flag changed, nothing else", so the report says what else changed: each arm's
resolved `[mega_moe]` settings, which router and expert path actually ran (the converter's log line says;
the fused router runs only with the Triton backend in eager mode, so the flag alone does not tell), and
every resolved config value that differs between the arms (per-arm overrides, the flag itself).
"""

from __future__ import annotations

from typing import Any

from . import config as cfg

MEGA_MOE_KEYS = ("enable", "precision", "backend", "fused_router", "save_under_sac", "ep_transport",
                 "ep_capacity_factor")
IGNORED = ("job.dump_folder",)  # differs by construction: each arm writes its own folder
STOCK_EXPERTS = "stock GroupedExperts"


def mega_moe_settings(values: dict, swap: dict | None) -> dict:
    """`[mega_moe]` as the arm resolved it, plus what ran (from the converter's log line `swap`)."""
    out: dict[str, Any] = {k: cfg.setting(values, f"mega_moe.{k}") for k in MEGA_MOE_KEYS}
    if not out["enable"]:
        return {**out, "experts_ran": STOCK_EXPERTS, "router_ran": "stock", "router_why": None}
    if swap is None:  # the arm failed before the swap, or its log did not say
        return {**out, "experts_ran": None, "router_ran": None, "router_why": None}
    # "router stock (torch.compile)": the router that ran is the first word, why (if said) the rest
    ran, _, why = swap["router"].partition(" ")
    return {**out, "experts_ran": f"fused op ({swap['backend']} backend, {swap['precision']})",
            "router_ran": ran, "router_why": why.strip("()") or None}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def differences(base: dict, cand: dict) -> list[dict]:
    """[{key, base, cand}] for every config value and ran-what fact that differs; `base`/`cand` are arm
    records with `resolved` (the trainer's JobConfig, or None), `requested` (TOML + overrides) and
    `mega_moe` (mega_moe_settings). The trainer's configs are compared when both arms wrote one."""
    which = "resolved" if base.get("resolved") and cand.get("resolved") else "requested"
    a, b = flatten(base[which]), flatten(cand[which])
    for k in MEGA_MOE_KEYS:  # defaults count: a key one arm's TOML leaves out still has a value
        a[f"mega_moe.{k}"], b[f"mega_moe.{k}"] = base["mega_moe"][k], cand["mega_moe"][k]
    for k in ("router_ran", "experts_ran"):
        a[k], b[k] = base["mega_moe"][k], cand["mega_moe"][k]
    keys = [k for k in dict.fromkeys([*a, *b]) if k not in IGNORED]
    return [{"key": k, "base": a.get(k), "cand": b.get(k)} for k in keys if a.get(k) != b.get(k)]


def describe(diffs: list[dict]) -> str:
    if not diffs:
        return "nothing (same resolved config, same router and expert path)"
    return "; ".join(f"{d['key']} ({d['base']} vs {d['cand']})" for d in diffs)
