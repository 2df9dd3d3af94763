"""titan-megamoe: a fused Mixture-of-Experts forward and backward for TorchTitan."""

from .ops import moe
from .precision import Precision
from .router import topk_route

__version__ = "0.1.0"


def use_tile_table(path):
    """Take the kernels' tile configs from a `titan-megamoe tune` table first (None: stop); see
    `kernels.configs.use_tile_table`. Imported on call: `import titan_megamoe` does not load Triton."""
    from .kernels.configs import use_tile_table as load

    return load(path)


__all__ = ["moe", "topk_route", "use_tile_table", "Precision", "__version__"]
