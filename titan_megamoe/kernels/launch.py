"""Kernel launches with less host time: `launch(kernel, grid, *args, **kwargs)` for `kernel[grid](...)`.

Triton's `kernel[grid](...)` binds every argument, works out each one's specialization, builds a cache
key from them and looks the compiled kernel up before it launches. On the H200's host that took 37 us
per GEMM1 launch (32 arguments) against 15 us for the launch itself (docs/kernels.md, host overhead);
the layer launches 12 kernels per forward+backward, and at small token counts the host, not the GPU,
sets the step time (30B-A3B at T=512 ran at 0.95x stock back-to-back).

`launch` keys each call on a summary that is at least as fine as Triton's specialization, which depends
only on: a tensor's dtype and whether its address is a multiple of 16; an integer's width class
(i32 / i64 / u64), whether it is 1 and whether it is a multiple of 16; a TMA descriptor's dtype and
block shape (a Gluon descriptor's also its layout); constexprs and launch options by value. The summary
keeps exactly those (plus the device and the argument names given by keyword). The first call with a
new summary goes through Triton, which compiles or finds the kernel and launches it; the compiled kernel
is kept under the summary and later calls launch it directly. `tests/test_launch.py` checks on the GPU that
the kernel picked is the one Triton picks, for each kind of argument.

Launch hooks (`triton.knobs.runtime.launch_enter_hook` / `launch_exit_hook`, set by profilers) are
called as Triton calls them. Through Triton every time: under the interpreter (CPU), with a kernel's
pre-run hooks, and for grids given as functions.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import INTERPRET

_TENSOR = torch.Tensor  # exactly: subclasses (nn.Parameter, ...) go through `_summary`


def _summary(arg):
    """What Triton specializes a runtime argument on, or something finer."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    kind = type(arg)
    if kind is int:
        # the same tuple `_FastLaunch._key` makes inline: i32 and i64 ranges, as Triton's width classes
        return ("int", arg == 1, arg % 16 == 0, -2147483648 <= arg < 2147483648,
                -9223372036854775808 <= arg < 9223372036854775808)
    if kind is TensorDescriptor:
        return "desc", arg.base.dtype, tuple(arg.block_shape), getattr(arg, "padding", None)
    if kind is GluonTensorDescriptor:  # Gluon's also carry their shared-memory layout (`fp8_rows_gluon`)
        return "gluon desc", arg.base.dtype, tuple(arg.block_shape), repr(arg.layout), arg.padding
    if arg is None or kind is bool or kind is float:
        return kind, arg if kind is not float else None
    return kind, arg  # anything else by value (hashable, or the call goes through Triton)


class _FastLaunch:
    def __init__(self, kernel):
        self.kernel = kernel
        params = list(inspect.signature(kernel.fn).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.constexpr_at = frozenset(i for i, p in enumerate(kernel.params) if p.is_constexpr)
        # runtime parameters given by keyword are summarised; constexprs and launch options (num_warps, ...)
        # are keyed by value
        self.runtime_names = frozenset(n for i, n in enumerate(self.names) if i not in self.constexpr_at)
        self.compiled = {}

    def _key(self, device, args, kwargs):
        """(device, positional summaries, keyword summaries): `_summary` of each runtime argument, a
        constexpr by value. Plain tensors and ints, most of a launch's arguments, are summarised inline
        (the same tuples `_summary` makes): a kernel of ~30 arguments spent ~40 us here per launch on the
        H100's host through a generator and a call per argument (`scripts/host_launches.py`)."""
        cx = self.constexpr_at
        pos = []
        append = pos.append
        for i, a in enumerate(args):
            kind = type(a)
            if i in cx:
                append(a)
            elif kind is _TENSOR:
                append((a.dtype, a.data_ptr() % 16 == 0))
            elif kind is int:
                append(("int", a == 1, a % 16 == 0, -2147483648 <= a < 2147483648,
                        -9223372036854775808 <= a < 9223372036854775808))
            else:
                append(_summary(a))
        runtime = self.runtime_names
        kw = []
        for k, v in kwargs.items():
            kw.append((k, _summary(v) if k in runtime else v))
        return device, tuple(pos), tuple(kw)

    def __call__(self, grid, args, kwargs):
        kernel = self.kernel
        if getattr(kernel, "pre_run_hooks", None) or callable(grid):
            kernel[grid](*args, **kwargs)
            return
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        try:
            key = self._key(device, args, kwargs)
            compiled = self.compiled.get(key)
        except TypeError:  # an argument that cannot be hashed: Triton's own path
            kernel[grid](*args, **kwargs)
            return
        if compiled is None:
            self.compiled[key] = kernel[grid](*args, **kwargs)
            return
        values = list(args)
        for name in self.names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        stream = driver.get_current_stream(device)
        # Triton's launch hooks (profilers) see the launch as they would through Triton
        knobs = triton.knobs.runtime
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        meta = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, meta, enter, leave, *values)


_launchers: dict = {}


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` with the host work of repeated launches cut (module docstring)."""
    if INTERPRET:
        kernel[grid](*args, **kwargs)
        return
    fast = _launchers.get(kernel)
    if fast is None:
        fast = _launchers[kernel] = _FastLaunch(kernel)
    fast(grid, args, kwargs)
