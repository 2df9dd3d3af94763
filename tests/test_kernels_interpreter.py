"""The fused Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1), small shapes.

Checked like the GPU tests: every output and gradient against a float64 oracle by the FlashAttention
rule, outputs poisoned with NaN, odd shapes and adversarial routing.
"""

import os
import subprocess
import sys


# the interpreter must be chosen before triton compiles anything: run the checks in a child process
# so the rest of the suite keeps ordinary Triton behaviour
HERE = os.path.dirname(os.path.abspath(__file__))

CASES = [
    # T, D, H, E, K, routing
    (37, 64, 48, 5, 3, "random"),
    (1, 32, 32, 4, 2, "random"),
    (3, 48, 80, 6, 1, "random"),
    (40, 32, 64, 7, 2, "skewed"),
    (29, 64, 32, 9, 2, "empty_experts"),
    (23, 32, 48, 4, 3, "one_expert"),
    (17, 32, 32, 3, 4, "duplicate_choices"),
]


def _run(code: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", TITAN_MEGAMOE_POISON="1", PYTHONPATH=HERE)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_fused_matches_oracle_under_interpreter():
    code = f"""
import torch
from moe_cases import make_case, reference_results, forward_backward, assert_flash_rule
import titan_megamoe
for i, (T, D, H, E, K, routing) in enumerate({CASES!r}):
    case = make_case(T, D, H, E, K, routing, seed=i)
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(100 + i)).bfloat16()
    ref64, bf16 = reference_results(case, dout)
    got = forward_backward(lambda *a: titan_megamoe.moe(*a, backend="triton"), case, dout)
    print((T, D, H, E, K, routing), "; ".join(assert_flash_rule(got, ref64, bf16)))
"""
    out = _run(code)
    assert out.count("dw3: err") == len(CASES), out


def test_forward_is_bitwise_reproducible_under_interpreter():
    code = """
import torch
from moe_cases import make_case
import titan_megamoe
case = make_case(33, 64, 32, 5, 2, "skewed", seed=7)
a = titan_megamoe.moe(*case.inputs(), backend="triton")
b = titan_megamoe.moe(*case.inputs(), backend="triton")
assert torch.equal(a, b)
print("bitwise-equal", a.float().abs().sum().item() > 0)
"""
    assert "bitwise-equal True" in _run(code)


def test_tma_operand_path_matches_oracle_under_interpreter():
    """TileConfig.tma: weights (and GEMM2/dx's contiguous A rows) through TMA descriptors; the
    interpreter emulates them, including the zero fill past a matrix's edge."""
    code = f"""
import dataclasses
import torch
from moe_cases import make_case, reference_results, forward_backward, assert_flash_rule
import titan_megamoe
from titan_megamoe.kernels import configs, gemm1_swiglu, grouped_gemm
configs._INTERPRETER = dataclasses.replace(configs._INTERPRETER, tma=True, warp_specialize=True)
# dgrad split with tma: dout's rows copied into sorted order, q from the grouped GEMM through TMA
configs._overrides["dgrad_swiglu"] = dataclasses.replace(configs._INTERPRETER, split=True, warp_specialize=False)
made = []
def counting(module):
    real = module.matrix_descriptor
    def wrapped(t, block):
        made.append((module.__name__.rsplit(".", 1)[1], tuple(block)))
        return real(t, block)
    module.matrix_descriptor = wrapped
counting(gemm1_swiglu)
counting(grouped_gemm)
from titan_megamoe.kernels import dgrad_swiglu
q_gemms = []
real_q = dgrad_swiglu.expert_h_grad
dgrad_swiglu.expert_h_grad = lambda *a, **k: q_gemms.append(1) or real_q(*a, **k)
for i, (T, D, H, E, K, routing) in enumerate({CASES!r}):
    case = make_case(T, D, H, E, K, routing, seed=i)
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(100 + i)).bfloat16()
    ref64, bf16 = reference_results(case, dout)
    got = forward_backward(lambda *a: titan_megamoe.moe(*a, backend="triton"), case, dout)
    print((T, D, H, E, K, routing), "; ".join(assert_flash_rule(got, ref64, bf16)))
print("descriptors", sorted(set(m for m, _ in made)), len(made))
print("dgrad q through the grouped GEMM", len(q_gemms))
"""
    out = _run(code)
    assert out.count("dw3: err") == len(CASES), out
    assert "descriptors ['gemm1_swiglu', 'grouped_gemm']" in out, out
    assert f"dgrad q through the grouped GEMM {len(CASES)}" in out, out


def test_split_dgrad_matches_oracle_under_interpreter():
    """TileConfig.split: dgrad's GEMM stores q (bf16) and an elementwise kernel does the dSwiGLU."""
    code = f"""
import dataclasses
import torch
from moe_cases import make_case, reference_results, forward_backward, assert_flash_rule
import titan_megamoe
from titan_megamoe.kernels import configs, dgrad_swiglu
configs._INTERPRETER = dataclasses.replace(configs._INTERPRETER, split=True)
launched = []
real = dgrad_swiglu._dswiglu_rows_kernel
class Counting:
    def __getitem__(self, grid):
        launched.append(grid)
        return real[grid]
dgrad_swiglu._dswiglu_rows_kernel = Counting()
for i, (T, D, H, E, K, routing) in enumerate({CASES!r}):
    case = make_case(T, D, H, E, K, routing, seed=i)
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(100 + i)).bfloat16()
    ref64, bf16 = reference_results(case, dout)
    got = forward_backward(lambda *a: titan_megamoe.moe(*a, backend="triton"), case, dout)
    print((T, D, H, E, K, routing), "; ".join(assert_flash_rule(got, ref64, bf16)))
print("rows kernel launches", len(launched))
"""
    out = _run(code)
    assert out.count("dw3: err") == len(CASES), out
    assert f"rows kernel launches {len(CASES)}" in out, out


def test_grouped_row_order_is_bitwise_the_plain_order_under_interpreter():
    """TileConfig.group_m: the row kernels' programs in groups down each N column (a partial last group
    too) compute the same tiles as the plain order: out and every gradient bitwise equal, bf16 and fp8."""
    code = """
import dataclasses
import torch
from moe_cases import make_case, forward_backward
import titan_megamoe
from titan_megamoe.kernels import configs
ROW = ("gemm1_swiglu", "gemm2", "dgrad_swiglu", "dx")
for precision, (T, D, H, E, K) in (("bf16", (45, 64, 96, 3, 2)), ("fp8", (40, 256, 256, 2, 2))):
    case = make_case(T, D, H, E, K, "skewed", seed=3)
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(5)).bfloat16()
    run = lambda: forward_backward(lambda *a: titan_megamoe.moe(*a, backend="triton", precision=precision), case, dout)
    plain = run()
    base = {k: configs.tile_config(k, D, H, precision) for k in ROW}
    configs._overrides.update({k: dataclasses.replace(c, group_m=3) for k, c in base.items()})
    grouped = run()
    configs._overrides.clear()
    same = all(torch.equal(plain[k], grouped[k]) for k in plain)
    print(precision, "bitwise", same, len(plain))
"""
    out = _run(code)
    assert "bf16 bitwise True" in out and "fp8 bitwise True" in out, out
