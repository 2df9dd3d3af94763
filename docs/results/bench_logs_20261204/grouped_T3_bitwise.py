import contextlib, dataclasses, torch, sys
sys.path.insert(0, "tests")
from moe_cases import make_case, reference_results, forward_backward, assert_flash_rule
import titan_megamoe
from titan_megamoe.kernels.configs import TileConfig, override_tile_config
G = {"gemm1_swiglu": (128, 128, 64, 8, 4, True, False, False, 8),
     "gemm2": (128, 256, 64, 8, 3, True, False, True, 8), "dx": (128, 256, 64, 8, 3, True, False, False, 8),
     "dgrad_swiglu": (128, 128, 32, 8, 4, False, True, False, 8)}
def run(group, case, dout):
    with contextlib.ExitStack() as st:
        for k, c in G.items():
            cfg = TileConfig(*c)
            st.enter_context(override_tile_config(k, dataclasses.replace(cfg, group_m=group)))
        return forward_backward(lambda *a: titan_megamoe.moe(*a, backend="triton"), case, dout)
for seed in range(4):
    case = make_case(3, 2048, 768, 128, 8, "random", device="cuda", seed=3 + 128 + 1)
    dout = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
    ref64, bf16 = reference_results(case, dout)
    a = run(8, case, dout); b = run(1, case, dout); c = run(8, case, dout)
    eq = {k: (torch.equal(a[k], b[k]), torch.equal(a[k], c[k])) for k in a}
    try:
        rep = assert_flash_rule(a, ref64, bf16); ok = "pass"
    except AssertionError as e:
        ok = str(e)[:160]
    print(seed, "grouped==plain / grouped==grouped:", eq, ok, flush=True)
