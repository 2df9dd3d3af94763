"""titan-megamoe: a fused Mixture-of-Experts forward and backward for TorchTitan."""

from .ops import moe
from .precision import Precision
from .router import topk_route

__version__ = "0.1.0"
__all__ = ["moe", "topk_route", "Precision", "__version__"]
