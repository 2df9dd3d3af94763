"""titan-megamoe: a fused Mixture-of-Experts forward and backward for TorchTitan."""

from .ops import moe
from .precision import Precision

__version__ = "0.1.0"
__all__ = ["moe", "Precision", "__version__"]
