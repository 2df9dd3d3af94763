"""The `mega_moe` model converter: validates the job and swaps every stock MoE layer for `MegaMoE`.

TorchTitan builds converters right after the meta model and applies them before `parallelize_fn`,
so every check here fails the job before any weight is allocated or any collective runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torchtitan.models.moe.moe import GroupedExperts, MoE
from torchtitan.tools.logging import logger

from ...precision import recipe_for
from ...validation import check_block_shapes, check_ep_transport
from ..mega_moe_section import MegaMoEConfigError, check_precision_backend, device_for_checks, load_tile_table
from .modules import MegaGroupedExperts, MegaMoE

CONVERTER_NAME = "mega_moe"


def _fail(msg: str):
    raise ValueError(f"[mega_moe] {msg}") from None  # the message is complete: no chained traceback


def check_job(job_config, parallel_dims) -> tuple[str, str]:
    """Validate the `[mega_moe]` section against the job; return (precision, resolved backend)."""
    cfg = job_config.mega_moe
    device = device_for_checks()
    try:
        recipe, backend = check_precision_backend(cfg.precision, cfg.backend, device)
    except MegaMoEConfigError as e:
        raise ValueError(str(e)) from None  # names the key and the fix: no chained traceback

    if parallel_dims is not None:
        if parallel_dims.tp > 1:
            _fail(f"tensor parallelism (parallelism.tensor_parallel_degree={parallel_dims.tp}) is not supported by "
                  f"mega_moe yet (TorchTitan's expert TP style expects stock GroupedExperts' inputs); use "
                  f"tensor_parallel_degree=1 or --mega_moe.no-enable")
        if parallel_dims.ep > 1:
            transport = resolve_ep_transport(cfg.ep_transport)
            if transport == "symm_mem" and backend == "reference":
                _fail("ep_transport='symm_mem' runs the Triton backend; the reference backend moves rows by "
                      "all-to-all: set --mega_moe.ep_transport all_to_all (or auto)")
            try:
                check_ep_transport(transport, cfg.ep_capacity_factor or None)
            except ValueError as e:
                _fail(f"{e} (here: set --mega_moe.ep_transport symm_mem or --mega_moe.ep_capacity_factor 0)")
            if (recipe.quantized() or recipe.quantized(backward=True)) and backend == "reference":
                _fail(f"precision={cfg.precision!r} with expert parallelism (expert_parallel_degree="
                      f"{parallel_dims.ep}) runs on the Triton kernels only (the reference backend's FP8 emulation "
                      f"has no EP path yet); set --mega_moe.backend triton (a GPU) or --mega_moe.precision bf16")
    quantized_experts = [c for c in job_config.model.converters if c.startswith("quantize.grouped_mm")]
    if quantized_experts:
        _fail(f"model.converters {quantized_experts} quantize the same expert GEMMs that mega_moe replaces; "
              f"drop them and pick the expert precision with --mega_moe.precision instead")
    return cfg.precision, backend


def resolve_ep_transport(value: str) -> str:
    """The transport `[mega_moe] ep_transport` names. `auto` picks all_to_all: the symmetric-memory
    transport has not been measured against it on GPUs yet (docs/ep.md)."""
    return "all_to_all" if value == "auto" else value


def sac_save_ops(early_stop: bool) -> tuple:
    """The fused op's forward steps `save_under_sac` saves (`titan_megamoe.ops`): titan_megamoe::moe_up, and
    without early stop also ::moe_down. TorchTitan's checkpointing reruns the whole block unless
    `activation_checkpoint.early_stop` is set, and with only moe_up saved that rerun would run GEMM2 and the
    combine again (which the one op saved whole never did); with early stop the recompute ends at moe_up and
    a saved moe_down output ([T, D]) would only take memory."""
    up, down = torch.ops.titan_megamoe.moe_up.default, torch.ops.titan_megamoe.moe_down.default
    return (up,) if early_stop else (up, down)


def set_sac_policy(save: bool, model_name: str = "qwen3", early_stop: bool = False) -> None:
    """Add (save=True) `sac_save_ops(early_stop)` to the model's op-level SAC save list
    (`torchtitan.models.<name>.infra.parallelize._op_sac_save_list`, which parallelize passes to apply_ac),
    or remove both steps."""
    import importlib

    try:
        save_list = importlib.import_module(f"torchtitan.models.{model_name}.infra.parallelize")._op_sac_save_list
    except (ImportError, AttributeError):
        if save:
            _fail(f"mega_moe.save_under_sac needs the op-level SAC save list of model {model_name!r} "
                  f"(torchtitan.models.{model_name}.infra.parallelize._op_sac_save_list), which does not exist; "
                  f"set mega_moe.save_under_sac=false")
        return
    save_list.difference_update(sac_save_ops(early_stop=False))
    if save:
        save_list.update(sac_save_ops(early_stop))


def swap_moe_layers(model: nn.Module, precision: str, backend: str, fused_router: bool = True,
                    ep_transport: str = "all_to_all", ep_capacity_factor: float | None = None) -> int:
    """Swap every stock MoE (and its GroupedExperts) in place; return how many were swapped."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not layers:
        _fail(f"mega_moe.enable is set but {type(model).__name__} has no MoE layers (a dense flavor?); "
              f"pick an MoE flavor (e.g. qwen3 debugmodel_moe, 30B-A3B) or set --mega_moe.no-enable")
    for name, m in layers:
        if type(m) not in (MoE, MegaMoE) or type(m.experts) not in (GroupedExperts, MegaGroupedExperts):
            _fail(f"{name} is a {type(m).__name__} with {type(m.experts).__name__} experts; mega_moe only "
                  f"replaces TorchTitan's stock MoE/GroupedExperts (was another converter applied first?)")
        if m.score_before_experts:
            _fail(f"{name} has score_before_experts=True (scores applied to the expert inputs), which the fused "
                  f"op does not support: it applies the scores after the experts (Qwen3's "
                  f"score_before_experts=False); use such a flavor or --mega_moe.no-enable")
        _, hidden, dim = m.experts.w1.shape
        try:  # block FP8 needs D and H in whole 128-blocks: say so when the job starts, not at the first step
            check_block_shapes(dim, hidden, recipe_for(precision))
        except ValueError as e:
            _fail(f"{name}: {e} (in a job: --mega_moe.precision bf16, or a flavor whose dim and moe_inter_dim are "
                  f"multiples of 128, e.g. megamoe_tiny_fp8)")
    for _, m in layers:
        m.__class__ = MegaMoE
        m.experts.__class__ = MegaGroupedExperts
        m.experts.precision = precision
        m.experts.backend = backend
        m.experts.ep_transport = ep_transport
        m.experts.ep_capacity_factor = ep_capacity_factor
        m.fused_router = fused_router
    return len(layers)


def _ac_note(ac, backend: str, save: bool, ep: bool = False) -> str:
    """What activation checkpointing does with the experts, for the log line."""
    op_sac = ac.mode == "selective" and ac.selective_ac_option == "op"
    if op_sac:
        mode = "AC selective op"
    elif ac.mode == "selective":
        mode = f"AC selective every {ac.selective_ac_option} layers"
    else:
        mode = f"AC {ac.mode}"
    if ac.mode not in ("full", "selective"):
        return mode
    if backend == "reference":  # plain aten ops, not the fused op: qwen3's save list decides as for stock
        return f"{mode} (reference ops follow qwen3's save list)" if op_sac else mode
    if op_sac and save and not ep:  # EP's autograd.Functions are not ops a SAC policy can name
        return f"{mode} (the fused op saved: {' and '.join(op.name() for op in sac_save_ops(ac.early_stop))})"
    if ac.early_stop:
        first = "route, rows out, GEMM1" if ep else "routing plan, GEMM1"
        return f"{mode} (the fused op's first step recomputed: {first}; not GEMM2 and the combine: early stop)"
    # without early stop TorchTitan's checkpointing reruns the whole block, the fused op's GEMM2 and combine
    # included, though the backward needs only what the op's first step makes (`titan_megamoe.ops`)
    return f"{mode} (the whole fused op recomputed: set activation_checkpoint.early_stop to skip its GEMM2)"


def _router_note(job_config, backend: str, fused_router: bool) -> str:
    """Which router the swapped layers run, for the log line (MegaMoE._router_is_fusable decides)."""
    if not fused_router or backend != "triton":
        return "router stock"
    comp = job_config.compile
    if comp.enable and "model" in comp.components:
        return "router stock (torch.compile)"
    ac = job_config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        return "router stock (op-level SAC)"
    return "router fused"


class MegaMoEConverter:
    """TorchTitan ModelConverter (protocols/model_converter.py) for `[mega_moe]`."""

    def __init__(self, job_config, parallel_dims):
        self.precision, self.backend = check_job(job_config, parallel_dims)
        self.save_under_sac = bool(job_config.mega_moe.save_under_sac)
        self.fused_router = bool(job_config.mega_moe.fused_router)
        self.model_name = job_config.model.name
        ep = parallel_dims.ep if parallel_dims is not None else 1
        self.early_stop = bool(job_config.activation_checkpoint.early_stop)
        self.ac_note = _ac_note(job_config.activation_checkpoint, self.backend, self.save_under_sac, ep > 1)
        self.router_note = _router_note(job_config, self.backend, self.fused_router)
        self.ep_transport = resolve_ep_transport(job_config.mega_moe.ep_transport)
        # 0 (exact sizes, host sync) -> None; without EP the factor has nothing to size
        self.ep_capacity_factor = (float(job_config.mega_moe.ep_capacity_factor) or None) if ep > 1 else None
        capacity = f", capacity factor {self.ep_capacity_factor:g}" if self.ep_capacity_factor else ""
        self.ep_note = f", EP {ep} ({self.ep_transport}{capacity})" if ep > 1 else ""
        self.tiles_note = ""
        if job_config.mega_moe.tile_table:
            try:
                self.tiles_note = f", tiles {load_tile_table(job_config.mega_moe.tile_table)}"
            except MegaMoEConfigError as e:
                raise ValueError(str(e)) from None

    def convert(self, model: nn.Module) -> None:
        n = swap_moe_layers(model, self.precision, self.backend, self.fused_router, self.ep_transport,
                            self.ep_capacity_factor)
        set_sac_policy(self.save_under_sac, self.model_name, self.early_stop)
        logger.info(f"[mega_moe] swapped {n} MoE layers to the fused op: precision={self.precision}, "
                    f"backend={self.backend}, {self.router_note}, {self.ac_note}{self.ep_note}{self.tiles_note}")

    def post_optimizer_hook(self, model) -> None:
        pass
