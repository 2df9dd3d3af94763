"""Expert parallelism for the swapped experts, with TorchTitan 0.2.2's own parameter layout.

TorchTitan's `apply_moe_ep_tp` (models/llama4/infra/parallelize.py, used by qwen3 too) applies
`ExpertParallel()` to every `moe.experts` module: it distributes w1/w2/w3 as DTensors Shard(0) over the
EP mesh and hooks the module's input and output with its token dispatch and combine. The swapped
`MegaGroupedExperts` takes (x, ids, scores) and moves the tokens itself (`titan_megamoe.moe(...,
ep_group=)`), so for it the style here does the same parameter sharding (same DTensor placements, FQNs
and checkpoint layout as stock EP, so checkpoints move both ways) and records the EP mesh instead of the
hooks. Any other module gets stock `ExpertParallel` unchanged. `install()` puts the style where
`apply_moe_ep_tp` looks the name up; FSDP, activation checkpointing and compile wrap the module as for
stock (TorchTitan never compiles `moe.experts`).
"""

from __future__ import annotations

from torchtitan.distributed.expert_parallel import ExpertParallel

_PARALLELIZE_MODULE = "torchtitan.models.llama4.infra.parallelize"


class MegaAwareExpertParallel(ExpertParallel):
    def _apply(self, module, device_mesh):
        from .modules import MegaGroupedExperts

        if not isinstance(module, MegaGroupedExperts):
            return super()._apply(module, device_mesh)
        self._partition_fn("", module, device_mesh)  # stock's Shard(0) of w1, w2, w3 over the EP mesh
        module.ep_mesh = device_mesh
        return module


def install() -> None:
    import importlib

    parallelize = importlib.import_module(_PARALLELIZE_MODULE)
    if parallelize.ExpertParallel is not MegaAwareExpertParallel:
        parallelize.ExpertParallel = MegaAwareExpertParallel
