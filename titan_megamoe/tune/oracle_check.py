"""Whether a tile config computes the layer right: the fused layer's forward and backward, with that config in
force, held to the float64 oracle by the FlashAttention rule the tests use.

Every output and gradient's max error against float64 must be at most `FACTOR` x that of the same math in
PyTorch (bf16: `moe_reference` in bf16; block FP8: the reference backend's emulation), with a floor of one
bf16 rounding of the largest value. The problem is the tuned shape's D, H, E, K at a smaller T (tile
configs depend on the kernel, D, H and precision only), so the float64 oracle stays cheap.
"""

from __future__ import annotations

import torch

from .. import ops
from ..kernels import configs
from ..oracle import moe_reference

FACTOR = 2.0
CHECK_TOKENS = 512  # 64 in Triton's CPU interpreter (tests), where a layer call of 512 takes ~20 s
NAMES = ("out", "dx", "dscores", "dw1", "dw2", "dw3")


def _forward_backward(fn, inputs, dout, cast=None):
    x, ids, s, w1, w2, w3 = inputs
    leaves = [(t.detach() if cast is None else t.detach().to(cast)).requires_grad_(True) for t in (x, s, w1, w2, w3)]
    out = fn(leaves[0], ids, leaves[1], *leaves[2:])
    out.backward(dout.to(out.dtype))
    return dict(zip(NAMES, [out.detach()] + [t.grad for t in leaves]))


class LayerCheck:
    """The oracle and the same-math errors for one (D, H, E, K, precision), computed once; `__call__` runs
    the fused layer (with whatever tile configs are in force) and returns the worst error ratio."""

    def __init__(self, D: int, H: int, E: int, K: int, precision: str, device, seed: int = 1):
        self.precision = "fp8" if precision == "fp8" else "bf16"
        g = torch.Generator(device=device).manual_seed(seed)
        T = 64 if configs.interpreting() else CHECK_TOKENS
        bf = torch.bfloat16
        x = torch.randn(T, D, generator=g, device=device).to(bf)
        ids = torch.argsort(torch.rand(T, E, generator=g, device=device), dim=1)[:, :K]
        scores = torch.softmax(torch.randn(T, K, generator=g, device=device), dim=1)
        w = [(torch.randn(*shape, generator=g, device=device) / shape[-1] ** 0.5).to(bf)
             for shape in ((E, H, D), (E, D, H), (E, H, D))]
        self.inputs = (x, ids, scores, *w)
        self.dout = torch.randn(T, D, generator=g, device=device).to(bf)
        self.ref64 = _forward_backward(lambda *a: moe_reference(*a, compute_dtype=torch.float64), self.inputs,
                                       self.dout, torch.float64)
        same = _forward_backward(lambda *a: ops.moe(*a, precision=self.precision, backend="reference"),
                                 self.inputs, self.dout)
        self.base = {n: max(self._err(same[n], n), 2.0**-9 * self.ref64[n].abs().max().item()) for n in NAMES}

    def _err(self, t, name) -> float:
        return (t.double() - self.ref64[name]).abs().max().item()

    def __call__(self) -> tuple[float, str]:
        """(the worst error as a multiple of the same math's, over every output and gradient; its name).
        Above FACTOR fails; a NaN counts as infinite."""
        got = _forward_backward(lambda *a: ops.moe(*a, precision=self.precision, backend="triton"),
                                self.inputs, self.dout)
        worst, which = 0.0, ""
        for n in NAMES:
            err = self._err(got[n], n)
            ratio = err / self.base[n] if err == err else float("inf")
            if ratio > worst:
                worst, which = ratio, n
        return worst, which
