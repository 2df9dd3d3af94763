"""The `[mega_moe]` config section: TorchTitan 0.2.2's custom config module for titan-megamoe.

Load it with `[job] custom_config_module = "titan_megamoe.integrations.torchtitan.config"` in the
TOML (or `--job.custom_config_module ...` on the command line). 0.2.2's ConfigManager merges the
`JobConfig` dataclass below into its own while parsing; the older `--experimental.custom_args_module`
spelling is only copied into `job.custom_config_module` *after* parsing, too late for a `[mega_moe]`
table or `--mega_moe.*` flags to parse.

Besides `[mega_moe]`, the module changes one default: `model.hf_assets_path` points at the
tokenizer bundled in the installed package (TorchTitan's default, ./tests/assets/tokenizer, exists
only inside a TorchTitan checkout). A TOML or CLI value still wins.

The section itself (fields, defaults, checks) is `integrations/mega_moe_section.py`, which imports no
TorchTitan. A misspelt TOML key gets our error listing the valid keys (the hook on ConfigManager below)
instead of TorchTitan's generic one.

No `from __future__ import annotations` here: ConfigManager merges sections by checking
`dataclasses.is_dataclass(field.type)`, which needs real types, not strings.
"""

import functools
from dataclasses import dataclass, field

from ..assets import TOKENIZER_DIR
from ..mega_moe_section import MegaMoE, check_section


@dataclass
class Model:
    hf_assets_path: str = str(TOKENIZER_DIR)
    """Tokenizer (and HF checkpoint) directory. With titan-megamoe's config module: the tokenizer bundled in the package."""


@dataclass
class JobConfig:
    mega_moe: MegaMoE = field(default_factory=MegaMoE)
    model: Model = field(default_factory=Model)


def _install_toml_key_check() -> None:
    """Check `[mega_moe]` tables before TorchTitan's ConfigManager turns them into MegaMoE.

    ConfigManager._dict_to_dataclass rejects unknown keys with a hint about `./run_train.sh` (a TorchTitan
    checkout script) before the dataclass is built; for our section, ours answers first. TorchTitan imports
    this module (job.custom_config_module) before it reads the TOML's sections, so the hook is in time.
    """
    from torchtitan.config.manager import ConfigManager

    original = ConfigManager._dict_to_dataclass
    if getattr(original, "_titan_megamoe", False):
        return

    @functools.wraps(original)
    def _dict_to_dataclass(self, cls, data):
        if cls is MegaMoE and isinstance(data, dict):
            check_section(data)
        return original(self, cls, data)

    _dict_to_dataclass._titan_megamoe = True
    ConfigManager._dict_to_dataclass = _dict_to_dataclass


_install_toml_key_check()
