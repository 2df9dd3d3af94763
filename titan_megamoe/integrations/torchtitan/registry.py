"""What `import titan_megamoe.integrations.torchtitan` registers in TorchTitan 0.2.2 (idempotently).

- Qwen3 flavors: `megamoe_tiny` (CPU demo/tests), `megamoe_tiny_fp8` (the same with an expert hidden dim of
  128, block FP8's multiple), `30B-A3B-1gpu` (30B-A3B layer shapes, as many layers as fit one H200) and
  `30B-A3B-80gb` (the same with fewer layers, for an 80 GB H100), added to `torchtitan.models.qwen3.qwen3_args`.
- The bundled dataset `megamoe_tiny` in `torchtitan.hf_datasets.text_datasets.DATASETS` (a local JSONL
  file inside the package: no download, any cwd).
- The model converter `mega_moe`, and the `[mega_moe] enable` flag: TorchTitan's converter container is
  wrapped so that the converter joins `model.converters` whenever `job_config.mega_moe.enable` is set.
- Expert parallelism for the swapped experts (`expert_parallel.install`: stock's parameter sharding,
  our token transport).
"""

from __future__ import annotations

import copy
import json

from ..assets import CORPUS_FILE, DATASET_NAME, TOKENIZER_VOCAB_SIZE
from .converter import CONVERTER_NAME, MegaMoEConverter


def tiny_flavor():
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    return Qwen3ModelArgs(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        max_seq_len=1024,
        head_dim=32,
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        qk_norm=True,
        hidden_dim=384,  # unused: every layer is MoE
        rope_theta=1000000,
        eos_id=1,  # the bundled tokenizer's <|end_of_text|>
        moe_enabled=True,
        moe_inter_dim=96,
        moe_args=MoEArgs(
            num_experts=8,
            num_shared_experts=0,
            top_k=2,
            score_func="softmax",
            route_norm=True,
            route_scale=1.0,
            score_before_experts=False,
        ),
    )


# One H200 (141 GB) holds 8 of 30B-A3B's layers with AdamW fp32 state at seq_len 16384; see
# configs/qwen3_30b_a3b_1gpu.toml for the estimate.
QWEN3_30B_A3B_1GPU_LAYERS = 8
# An 80 GB GPU (H100) holds 3 of them at seq_len 8192; configs/qwen3_30b_a3b_80gb.toml has the estimate.
QWEN3_30B_A3B_80GB_LAYERS = 3


def tiny_fp8_flavor():
    """The tiny flavor with block FP8's shapes: D and the expert hidden dim multiples of 128."""
    args = tiny_flavor()
    args.moe_inter_dim = 128
    return args


def qwen3_30b_a3b_layers_flavor(qwen3_args, n_layers: int):
    """Qwen3-30B-A3B with its first `n_layers` layers: every layer shape as the full model's."""
    args = copy.deepcopy(qwen3_args["30B-A3B"])
    args.n_layers = n_layers
    return args


def register_flavors() -> None:
    from torchtitan.models.qwen3 import qwen3_args

    if "megamoe_tiny" not in qwen3_args:
        qwen3_args["megamoe_tiny"] = tiny_flavor()
    if "megamoe_tiny_fp8" not in qwen3_args:
        qwen3_args["megamoe_tiny_fp8"] = tiny_fp8_flavor()
    if "30B-A3B-1gpu" not in qwen3_args:
        qwen3_args["30B-A3B-1gpu"] = qwen3_30b_a3b_layers_flavor(qwen3_args, QWEN3_30B_A3B_1GPU_LAYERS)
    if "30B-A3B-80gb" not in qwen3_args:
        qwen3_args["30B-A3B-80gb"] = qwen3_30b_a3b_layers_flavor(qwen3_args, QWEN3_30B_A3B_80GB_LAYERS)


def _load_jsonl_texts(path: str):
    from datasets import Dataset

    with open(path) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return Dataset.from_dict({"text": texts})  # in memory: no HF cache, no network


def register_dataset() -> None:
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    if DATASET_NAME not in DATASETS:
        DATASETS[DATASET_NAME] = DatasetConfig(
            path=str(CORPUS_FILE),
            loader=_load_jsonl_texts,
            sample_processor=lambda sample: sample["text"],
        )


def register_converter() -> None:
    from torchtitan.protocols import model_converter as mc

    if CONVERTER_NAME not in mc._registry_model_converter_cls:
        mc.register_model_converter(MegaMoEConverter, CONVERTER_NAME)

    # `[mega_moe] enable = true` alone turns the swap on. The container class is the seam that both
    # `torchrun -m torchtitan.train` (Trainer defined in __main__) and `torchtitan.train.main` share.
    container = mc.ModelConvertersContainer
    if getattr(container.__init__, "_titan_megamoe", False):
        return
    original_init = container.__init__

    def __init__(self, job_config, parallel_dims):
        mega = getattr(job_config, "mega_moe", None)
        extra = None
        if mega is not None and mega.enable and CONVERTER_NAME not in job_config.model.converters:
            extra = MegaMoEConverter(job_config, parallel_dims)  # validates first: its errors name the fix
        original_init(self, job_config, parallel_dims)
        if extra is not None:
            self.converters.append(extra)  # applied after the listed converters

    __init__._titan_megamoe = True
    container.__init__ = __init__


def register_all() -> None:
    from . import expert_parallel

    register_flavors()
    register_dataset()
    register_converter()
    expert_parallel.install()
