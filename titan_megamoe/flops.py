"""FLOP convention shared with the peers (SonicMoE, Liger, DeepGEMM): recompute is not counted."""


def moe_flops(tokens: int, top_k: int, dim: int, hidden: int, backward: bool = True) -> int:
    """fwd = 6*T*K*D*H (GEMM1 gate+up 4, GEMM2 2); fwd+bwd = 18*T*K*D*H."""
    return (18 if backward else 6) * tokens * top_k * dim * hidden
