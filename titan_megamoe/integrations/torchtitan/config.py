"""The `[mega_moe]` config section: TorchTitan 0.2.2's custom config module for titan-megamoe.

Load it with `[job] custom_config_module = "titan_megamoe.integrations.torchtitan.config"` in the
TOML (or `--job.custom_config_module ...` on the command line). 0.2.2's ConfigManager merges the
`JobConfig` dataclass below into its own while parsing; the older `--experimental.custom_args_module`
spelling is only copied into `job.custom_config_module` *after* parsing, too late for a `[mega_moe]`
table or `--mega_moe.*` flags to parse.

Besides `[mega_moe]`, the module changes one default: `model.hf_assets_path` points at the
tokenizer bundled in the installed package (TorchTitan's default, ./tests/assets/tokenizer, exists
only inside a TorchTitan checkout). A TOML or CLI value still wins.

No `from __future__ import annotations` here: ConfigManager merges sections by checking
`dataclasses.is_dataclass(field.type)`, which needs real types, not strings.
"""

from dataclasses import dataclass, field

from .assets import TOKENIZER_DIR


@dataclass
class MegaMoE:
    enable: bool = False
    """Run every MoE layer's routed experts through titan-megamoe's fused op (same parameters, FQNs and checkpoints as stock)."""

    precision: str = "bf16"
    """bf16 | fp8 | fp8_bwd | mxfp8. Implemented: bf16. fp8 (block FP8) and fp8_bwd (FP8 backward only): not yet. mxfp8: Blackwell only."""

    backend: str = "auto"
    """auto | triton | reference. auto: the fused Triton kernels on CUDA, the pure-PyTorch reference (stock's rounding) elsewhere."""

    fused_router: bool = True
    """With the Triton backend: the router's softmax/sigmoid, expert bias, top-k and normalisation in one kernel (same math as stock; ties to the lowest expert id). false = TorchTitan's router module."""

    save_under_sac: bool = False
    """Under op-level SAC: false = the fused op is recomputed in backward like stock's grouped GEMMs; true = its outputs are saved."""


@dataclass
class Model:
    hf_assets_path: str = str(TOKENIZER_DIR)
    """Tokenizer (and HF checkpoint) directory. With titan-megamoe's config module: the tokenizer bundled in the package."""


@dataclass
class JobConfig:
    mega_moe: MegaMoE = field(default_factory=MegaMoE)
    model: Model = field(default_factory=Model)
