"""The bf16 GEMMs the layer runs, compiled for sm_90 on the CPU with the tile configs the table ships (Triton's
bundled ptxas and cuobjdump; no GPU needed): each lowers to wgmma (HGMMA in the SASS) and nothing spills to
the stack. GEMM1, GEMM2, dx and dgrad's GEMM at Qwen3-30B-A3B's and Qwen3-235B-A22B's (D, H); the weight
gradients' configs are tests/test_kernel_wgrad.py's, the FP8 kernels' tests/test_fp8_kernels.py's. The GPU
machine's Triton (3.6) may allocate registers differently from the local one: a guard, not the binary that
runs there."""

from __future__ import annotations

import pytest

from moe_cases import sm90_compile_results, stack_bytes

SHAPES = {"30b-a3b": (2048, 768), "235b-a22b": (4096, 1536)}

_SCRIPT = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import shipped_bf16_rows
print(json.dumps({shape: {name: {k: r[k] for k in ("hgmma", "qgmma", "usage", "wgmma_ir")}
                          for name, r in shipped_bf16_rows(*dh).items()}
                  for shape, dh in %r.items()}))
""" % SHAPES


@pytest.fixture(scope="module")
def compiled():
    return sm90_compile_results(_SCRIPT, timeout=600)


@pytest.mark.parametrize("shape", SHAPES)
def test_shipped_bf16_row_kernels_compile_to_wgmma_without_spills(compiled, shape):
    got = compiled[shape]
    assert set(got) == {"gemm1", "gemm2", "dx", "dgrad"}
    for name, r in got.items():
        assert r["wgmma_ir"] and r["hgmma"] > 0, f"{shape} {name}: no bf16 wgmma (HGMMA) in the SASS"
        assert r["qgmma"] == 0, f"{shape} {name}: an FP8 wgmma in a bf16 kernel"
        assert stack_bytes(r["usage"]) == 0, f"{shape} {name}: register spills: {r['usage']}"
