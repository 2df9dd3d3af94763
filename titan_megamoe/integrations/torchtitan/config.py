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
    """Replace the routed-expert path of every MoE layer with titan-megamoe's fused op (same
    parameters, FQNs and checkpoints as stock; the swap runs on the meta model before parallelize)."""

    precision: str = "bf16"
    """Expert GEMM precision: bf16 | fp8 | fp8_bwd | mxfp8. bf16 is implemented; fp8 (Hopper block
    FP8 forward and backward) and fp8_bwd (bf16 forward, FP8 backward) are not yet; mxfp8 needs a
    Blackwell (sm_100) GPU."""

    backend: str = "auto"
    """auto | triton | reference. auto = the fused Triton kernels on CUDA, the pure-PyTorch reference
    (which reproduces stock TorchTitan's rounding) elsewhere."""

    save_under_sac: bool = False
    """Under op-level selective activation checkpointing: False = the fused op is recomputed in the
    backward, like stock's grouped GEMMs; True = SAC saves its outputs (adds
    titan_megamoe::moe_forward to qwen3's op save list: more memory, no expert recompute)."""


@dataclass
class Model:
    hf_assets_path: str = str(TOKENIZER_DIR)
    """Directory of the tokenizer (tokenizer.json, tokenizer_config.json) and HF checkpoint files.
    With titan-megamoe loaded it defaults to the tiny BPE tokenizer bundled in the package."""


@dataclass
class JobConfig:
    mega_moe: MegaMoE = field(default_factory=MegaMoE)
    model: Model = field(default_factory=Model)
