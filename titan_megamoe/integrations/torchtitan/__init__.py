"""TorchTitan 0.2.2 adapter: `--experimental.custom_import titan_megamoe.integrations.torchtitan`.

Importing this package registers the `mega_moe` model converter, makes `[mega_moe] enable = true`
turn it on, and adds the `megamoe_tiny` / `megamoe_tiny_fp8` / `30B-A3B-1gpu` / `30B-A3B-80gb` Qwen3 flavors
and the bundled `megamoe_tiny` dataset (see registry.py). The `[mega_moe]` section itself comes from the config module
(`[job] custom_config_module = "titan_megamoe.integrations.torchtitan.config"`). Every module that
imports TorchTitan lives in this package; the launcher and what it needs (`integrations/launch.py`,
`mega_moe_section.py`, `failure.py`, `assets.py`) live beside it, so `titan-megamoe train` does not import
TorchTitan before it starts torchrun.
"""

from .registry import register_all

register_all()
