"""TorchTitan 0.2.2 adapter, in process (no trainer launch): config, registration, swap, errors, launcher.

The model builds follow the Trainer's own path: ConfigManager -> train spec -> meta model ->
build_model_converters(...).convert(model).
"""

from __future__ import annotations

import copy
import importlib
import os
from pathlib import Path

import pytest
import torch

import titan_megamoe.integrations.torchtitan as tt
from titan_megamoe.integrations import assets, launch
from titan_megamoe.integrations.torchtitan import cpu, registry
from titan_megamoe.integrations.torchtitan.converter import (MegaMoEConverter, sac_save_ops, set_sac_policy,
                                                             swap_moe_layers)
from titan_megamoe.integrations.torchtitan.modules import MegaGroupedExperts, MegaMoE
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.models.moe.moe import GroupedExperts, MoE
from torchtitan.protocols import model_converter as mc
from torchtitan.protocols.train_spec import get_train_spec

REPO = Path(__file__).resolve().parents[1]
TINY = assets.CONFIGS_DIR / "tiny_cpu.toml"
CONFIGS = sorted(assets.CONFIGS_DIR.glob("*.toml"))


def parse(*overrides: str, config: Path = TINY):
    return ConfigManager().parse_args(["--job.config_file", str(config), *overrides])


def dims(ep: int = 1, tp: int = 1) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=max(ep, 1), cp=1, tp=tp, pp=1, ep=ep, etp=1,
                        world_size=max(ep, 1) * tp)


def meta_model(job_config, model_args=None):
    spec = get_train_spec(job_config.model.name)
    args = copy.deepcopy(model_args or spec.model_args[job_config.model.flavor])
    args.update_from_config(job_config)
    with torch.device("meta"):
        return spec.model_cls(args)


def build_and_convert(*overrides: str, parallel_dims=None, config: Path = TINY):
    job_config = parse(*overrides, config=config)
    model = meta_model(job_config)
    mc.build_model_converters(job_config, parallel_dims or dims()).convert(model)
    return model


def tensors(model):
    out = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    out.update({f"buffer:{k}": (tuple(v.shape), v.dtype) for k, v in model.named_buffers()})
    return out


# ---------------------------------------------------------------- config, assets, registration


def test_config_section_and_defaults():
    c = parse()
    assert (c.mega_moe.enable, c.mega_moe.precision, c.mega_moe.backend, c.mega_moe.save_under_sac) == (
        False, "bf16", "auto", False)
    assert c.mega_moe.fused_router and not parse("--mega_moe.no-fused-router").mega_moe.fused_router
    c = parse("--mega_moe.enable", "--mega_moe.precision", "fp8", "--mega_moe.backend", "reference",
              "--mega_moe.save_under_sac")
    assert (c.mega_moe.enable, c.mega_moe.precision, c.mega_moe.backend, c.mega_moe.save_under_sac) == (
        True, "fp8", "reference", True)
    # hf_assets_path defaults to the tokenizer inside the package, whatever the cwd
    assert Path(c.model.hf_assets_path) == assets.TOKENIZER_DIR
    assert (assets.TOKENIZER_DIR / "tokenizer.json").is_file()


def test_config_field_docstrings_reach_help(capsys):
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(["--job.custom_config_module", "titan_megamoe.integrations.torchtitan.config",
                                    "--help"])
    text = capsys.readouterr().out
    assert "mega_moe.save_under_sac" in text or "mega-moe.save-under-sac" in text
    assert "Blackwell" in text


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_bundled_configs(path):
    text = path.read_text()
    assert text.startswith("# Hardware:"), "each config starts by naming its hardware"
    c = parse(config=path)
    assert c.experimental.custom_import == "titan_megamoe.integrations.torchtitan"
    assert c.job.custom_config_module == "titan_megamoe.integrations.torchtitan.config"
    assert c.mega_moe.enable is False
    assert c.model.name == "qwen3" and c.model.flavor in get_train_spec("qwen3").model_args
    assert c.training.dataset == assets.DATASET_NAME
    assert c.parallelism.expert_parallel_degree == 1
    meta_model(c)  # the flavor builds


def test_expected_config_set_and_symlink():
    assert {p.stem for p in CONFIGS} >= {"tiny_cpu", "qwen3_moe_debug", "qwen3_30b_a3b_1gpu", "qwen3_30b_a3b_80gb",
                                          "qwen3_30b_a3b", "qwen3_235b_a22b"}
    link = REPO / "train_configs"
    assert link.is_symlink() and os.readlink(link) == "titan_megamoe/configs"


@pytest.mark.parametrize("config, flavor, layers, params, seq_len", [
    ("qwen3_30b_a3b_1gpu", "30B-A3B-1gpu", registry.QWEN3_30B_A3B_1GPU_LAYERS, 5.61e9, 16384),
    ("qwen3_30b_a3b_80gb", "30B-A3B-80gb", registry.QWEN3_30B_A3B_80GB_LAYERS, 2.49e9, 8192),
])
def test_30b_one_gpu_flavors_match_estimates(config, flavor, layers, params, seq_len):
    from torchtitan.models.qwen3 import qwen3_args

    full, small = qwen3_args["30B-A3B"], qwen3_args[flavor]
    assert (small.dim, small.moe_inter_dim, small.moe_args.num_experts, small.moe_args.top_k) == (2048, 768, 128, 8)
    assert small.n_layers == layers < full.n_layers
    c = parse(config=assets.CONFIGS_DIR / f"{config}.toml")
    assert c.model.flavor == flavor and c.training.seq_len == seq_len
    n = sum(p.numel() for p in meta_model(c).parameters())
    assert abs(n - params) < 0.01e9  # the count the config's memory estimate uses


def test_tokenizer_and_dataset_assets():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.models.qwen3 import qwen3_args

    tok = HuggingFaceTokenizer(str(assets.TOKENIZER_DIR))
    assert tok.get_vocab_size() == assets.TOKENIZER_VOCAB_SIZE == qwen3_args["megamoe_tiny"].vocab_size
    assert tok.get_vocab_size() <= qwen3_args["debugmodel_moe"].vocab_size
    ids = tok.encode("Ada repaired the rusty lantern slowly.", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id == qwen3_args["megamoe_tiny"].eos_id
    assert tok.decode(ids[1:-1]) == "Ada repaired the rusty lantern slowly."

    cfg = DATASETS[assets.DATASET_NAME]
    ds = cfg.loader(cfg.path)
    assert len(ds) > 300 and all(isinstance(cfg.sample_processor(ds[i]), str) for i in range(3))
    total = sum(f.stat().st_size for f in assets.ASSETS_DIR.rglob("*") if f.is_file())
    assert total < 2 * 1024 * 1024


def test_registration_is_idempotent():
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.models.qwen3 import qwen3_args

    flavor, dataset = qwen3_args["megamoe_tiny"], DATASETS[assets.DATASET_NAME]
    init = mc.ModelConvertersContainer.__init__
    importlib.reload(registry)
    importlib.reload(tt)
    registry.register_all()
    assert qwen3_args["megamoe_tiny"] is flavor and DATASETS[assets.DATASET_NAME] is dataset
    assert mc.ModelConvertersContainer.__init__ is init
    assert "mega_moe" in mc._registry_model_converter_cls


# ---------------------------------------------------------------- the swap


def test_flag_alone_turns_the_converter_on():
    def converters(*overrides):
        c = parse(*overrides)
        return [type(x) for x in mc.build_model_converters(c, dims()).converters]

    assert converters() == []
    assert converters("--mega_moe.enable") == [MegaMoEConverter]
    assert converters("--model.converters", "mega_moe") == [MegaMoEConverter]
    assert converters("--model.converters", "mega_moe", "--mega_moe.enable") == [MegaMoEConverter]


@pytest.mark.parametrize("config", ["tiny_cpu", "qwen3_moe_debug", "qwen3_30b_a3b"])
def test_swap_keeps_state_dict_and_buffers(config):
    path = assets.CONFIGS_DIR / f"{config}.toml"
    stock = build_and_convert(config=path)
    mega = build_and_convert("--mega_moe.enable", "--mega_moe.backend", "reference", config=path)
    assert tensors(stock) == tensors(mega)
    assert [n for n, _ in stock.named_modules()] == [n for n, _ in mega.named_modules()]
    moes = [m for m in mega.modules() if isinstance(m, MoE)]
    assert moes and all(type(m) is MegaMoE and type(m.experts) is MegaGroupedExperts for m in moes)
    assert all(m.experts.precision == "bf16" and m.experts.backend == "reference" for m in moes)
    assert all(type(m) is MoE and type(m.experts) is GroupedExperts for m in stock.modules() if isinstance(m, MoE))


def test_swap_keeps_parameter_count_and_flops():
    c_stock, c_mega = parse(), parse("--mega_moe.enable")
    stock, mega = build_and_convert(), build_and_convert("--mega_moe.enable")
    args = get_train_spec("qwen3").model_args["megamoe_tiny"]
    assert args.get_nparams_and_flops(stock, c_stock.training.seq_len) == \
        args.get_nparams_and_flops(mega, c_mega.training.seq_len)


@pytest.fixture
def cpu_moe_ops(monkeypatch):
    """The two CPU patches stock MoE needs to run on CPU tensors, scoped to one test."""
    from torchtitan.models.moe import utils as moe_utils

    monkeypatch.setattr(torch, "histc", cpu.histc_int_cpu(torch.histc))
    monkeypatch.setattr(moe_utils, "generate_permute_indices",
                        cpu.permute_indices_cpu(moe_utils.generate_permute_indices))


def _stock_and_mega_layer(dtype):
    torch.manual_seed(0)
    args = registry.tiny_flavor()
    stock = MoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_inter_dim)
    with torch.no_grad():
        stock.init_weights(0.02, torch.device("cpu"))
        stock.expert_bias.uniform_(-0.01, 0.01)  # routing must still use it
    stock = stock.to(dtype)
    mega = copy.deepcopy(stock)
    holder = torch.nn.Module()
    holder.moe = mega
    assert swap_moe_layers(holder, "bf16", "reference") == 1
    x = torch.randn(3, 64, args.dim, dtype=dtype)
    dout = torch.randn(3, 64, args.dim, dtype=dtype)
    results = []
    for m in (stock, mega):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dout)
        results.append((m, xi, y))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapped_layer_matches_stock_bitwise(cpu_moe_ops, dtype):
    """Forward output, input and parameter gradients and the load-balancing counts are bitwise stock's."""
    (stock, x_stock, y_stock), (mega, x_mega, y_mega) = _stock_and_mega_layer(dtype)
    assert torch.equal(y_stock, y_mega)
    assert torch.equal(x_stock.grad, x_mega.grad)
    grads = dict(mega.named_parameters())
    for name, p in stock.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
    assert torch.equal(stock.tokens_per_expert, mega.tokens_per_expert)
    assert stock.tokens_per_expert.sum() == 3 * 64 * 2


@pytest.mark.parametrize("fused_router", [True, False])
def test_triton_layer_with_fused_router_matches_stock(cpu_moe_ops, monkeypatch, fused_router):
    """The whole swapped layer on the Triton kernels (GPU, or the interpreter on CPU): with fused_router
    the router math after the gate is the fused kernel; routing, load-balancing counts and every gradient
    agree with stock's layer (bf16, so values within bf16 rounding, counts exactly)."""
    from titan_megamoe.integrations.torchtitan import modules

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    real = modules.topk_route
    monkeypatch.setattr(modules, "topk_route", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(1)
    args = registry.tiny_flavor()
    stock = MoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_inter_dim)
    with torch.no_grad():
        stock.init_weights(0.02, torch.device("cpu"))
        stock.expert_bias.uniform_(-0.01, 0.01)
    stock = stock.to(dev, torch.bfloat16)
    stock.expert_bias, stock.tokens_per_expert = stock.expert_bias.float(), stock.tokens_per_expert.float()
    mega = copy.deepcopy(stock)
    holder = torch.nn.Module()
    holder.moe = mega
    swap_moe_layers(holder, "bf16", "triton", fused_router=fused_router)
    x = torch.randn(2, 48, args.dim, device=dev, dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    outs = []
    for m in (stock, mega):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dout)
        outs.append({"out": y, "dx": xi.grad, **{n: p.grad for n, p in m.named_parameters()}})
    assert len(calls) == (1 if fused_router else 0)
    assert torch.equal(stock.tokens_per_expert, mega.tokens_per_expert)
    for name, ref in outs[0].items():
        err = ((outs[1][name].float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 2e-2, f"{name}: relative L2 {err:.2e} against stock"


@pytest.mark.parametrize("overrides, backend, note", [
    ((), "triton", "router fused"),
    (("--mega_moe.no-fused-router",), "triton", "router stock"),
    ((), "reference", "router stock"),
    (("--compile.enable",), "triton", "router stock (torch.compile)"),
    (("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"), "triton",
     "router stock (op-level SAC)"),
])
def test_log_line_names_the_router_that_runs(overrides, backend, note):
    from titan_megamoe.integrations.torchtitan.converter import _router_note

    job = parse("--mega_moe.enable", *overrides)
    assert _router_note(job, backend, job.mega_moe.fused_router) == note


def test_dcp_checkpoint_round_trip_stock_mega_stock(tmp_path):
    """A torch.distributed.checkpoint written from one arm loads into the other with every tensor equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    def model(mega: bool, seed: int):
        m = build_and_convert(*(["--mega_moe.enable"] if mega else []))
        m.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            m.init_weights(buffer_device=torch.device("cpu"))
            for layer in m.layers.values():
                layer.moe.expert_bias.uniform_(-1, 1)
        return m

    stock, mega, stock2 = model(False, 1), model(True, 2), model(False, 3)
    dcp.save(get_model_state_dict(stock), checkpoint_id=str(tmp_path / "a"))
    sd = get_model_state_dict(mega)
    dcp.load(sd, checkpoint_id=str(tmp_path / "a"))
    set_model_state_dict(mega, sd)
    for (k, a), (k2, b) in zip(stock.state_dict().items(), mega.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    dcp.save(get_model_state_dict(mega), checkpoint_id=str(tmp_path / "b"))
    sd = get_model_state_dict(stock2)
    dcp.load(sd, checkpoint_id=str(tmp_path / "b"))
    set_model_state_dict(stock2, sd)
    for (k, a), b in zip(stock.state_dict().items(), stock2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_save_under_sac_edits_qwen3_save_list():
    """Both steps of the fused op without early stop (a saved moe_up alone would leave GEMM2 to rerun),
    moe_up alone with it (the recompute ends there); `--mega_moe.no-save-under-sac` removes both."""
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

    up, down = sac_save_ops(early_stop=False)
    try:
        build_and_convert("--mega_moe.enable", "--mega_moe.save_under_sac")
        assert {up, down} <= _op_sac_save_list
        build_and_convert("--mega_moe.enable", "--mega_moe.save_under_sac", "--activation_checkpoint.early_stop")
        assert up in _op_sac_save_list and down not in _op_sac_save_list
        build_and_convert("--mega_moe.enable")
        assert not {up, down} & _op_sac_save_list
    finally:
        set_sac_policy(False)


_RERUN = "(the whole fused op recomputed: set activation_checkpoint.early_stop to skip its GEMM2)"
_FIRST = "(the fused op's first step recomputed: {}; not GEMM2 and the combine: early stop)"
_LOCAL, _EP = _FIRST.format("routing plan, GEMM1"), _FIRST.format("route, rows out, GEMM1")


@pytest.mark.parametrize("mode, option, early_stop, backend, save, ep, want", [
    ("full", "2", False, "triton", False, False, f"AC full {_RERUN}"),
    ("full", "2", True, "triton", False, False, f"AC full {_LOCAL}"),
    ("full", "2", True, "triton", False, True, f"AC full {_EP}"),
    ("full", "2", False, "reference", False, False, "AC full"),
    ("selective", "2", False, "triton", False, False, f"AC selective every 2 layers {_RERUN}"),
    ("selective", "op", False, "triton", False, False, f"AC selective op {_RERUN}"),
    ("selective", "op", True, "triton", False, False, f"AC selective op {_LOCAL}"),
    ("selective", "op", False, "triton", True, False,
     "AC selective op (the fused op saved: titan_megamoe::moe_up and titan_megamoe::moe_down)"),
    ("selective", "op", True, "triton", True, False, "AC selective op (the fused op saved: titan_megamoe::moe_up)"),
    ("selective", "op", True, "triton", True, True, f"AC selective op {_EP}"),  # EP: no op a policy can name
    ("selective", "op", False, "reference", False, False, "AC selective op (reference ops follow qwen3's save list)"),
    ("none", "2", False, "triton", False, False, "AC none"),
    ("memory_budget", "2", False, "triton", False, False, "AC memory_budget"),
])
def test_ac_log_line_names_the_early_stop_that_skips_gemm2(mode, option, early_stop, backend, save, ep, want):
    """TorchTitan's checkpointing reruns the whole block unless `activation_checkpoint.early_stop` is set, and
    then the fused op's GEMM2 runs twice: the job's log line says what is recomputed and names the setting."""
    from types import SimpleNamespace

    from titan_megamoe.integrations.torchtitan.converter import _ac_note

    ac = SimpleNamespace(mode=mode, selective_ac_option=option, early_stop=early_stop)
    assert _ac_note(ac, backend, save, ep) == want



# ---------------------------------------------------------------- errors raised when the converter is built
# (unknown precision/backend names fail earlier, at parse: tests/test_mega_moe_config.py)


@pytest.mark.parametrize("overrides, parallel_dims, words", [
    (["--mega_moe.precision", "mxfp8"], None, ["mxfp8", "Blackwell", "bf16"]),
    ([], dims(tp=2), ["tensor parallelism", "tensor_parallel_degree=1"]),
    (["--mega_moe.ep_transport", "symm_mem", "--mega_moe.backend", "reference"], dims(ep=2),
     ["symm_mem", "Triton backend", "all_to_all"]),
    (["--mega_moe.ep_capacity_factor", "2"], dims(ep=2),
     ["ep_capacity_factor applies to ep_transport='symm_mem'", "'all_to_all'", "--mega_moe.ep_capacity_factor 0"]),
    (["--mega_moe.precision", "fp8", "--mega_moe.backend", "reference"], dims(ep=2),
     ["'fp8'", "expert parallelism", "--mega_moe.precision bf16"]),
    (["--model.converters", "quantize.grouped_mm.float8"], None, ["quantize.grouped_mm.float8", "--mega_moe.precision"]),
])
def test_bad_jobs_fail_when_the_converter_is_built(overrides, parallel_dims, words):
    c = parse("--mega_moe.enable", *overrides)
    with pytest.raises(ValueError) as e:
        mc.build_model_converters(c, parallel_dims or dims())
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_triton_backend_without_cuda_fails(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would make triton valid on CPU
    with pytest.raises(ValueError, match=r'backend = "triton" needs a CUDA GPU.*--mega_moe.backend auto'):
        mc.build_model_converters(parse("--mega_moe.enable", "--mega_moe.backend", "triton"), dims())


def test_a_tile_table_that_does_not_load_fails_in_the_converter(tmp_path):
    """The launchers check it first (`check_job_section`); a plain `torchrun -m torchtitan.train` has only this."""
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match=r"^\[mega_moe\] tile_table: tile table .*nope.json does not exist"):
        mc.build_model_converters(parse("--mega_moe.enable", "--mega_moe.tile_table", missing), dims())


def test_flag_on_dense_model_fails():
    with pytest.raises(ValueError, match=r"\[mega_moe\].*no MoE layers.*debugmodel_moe.*no-enable"):
        build_and_convert("--mega_moe.enable", "--model.flavor", "debugmodel")


def test_score_before_experts_fails():
    c = parse("--mega_moe.enable")
    args = copy.deepcopy(get_train_spec("qwen3").model_args["megamoe_tiny"])
    args.moe_args.score_before_experts = True
    model = meta_model(c, args)
    with pytest.raises(ValueError, match=r"score_before_experts=True.*not support"):
        mc.build_model_converters(c, dims()).convert(model)
    assert not any(isinstance(m, MegaMoE) for m in model.modules()), "nothing is swapped on error"


# ---------------------------------------------------------------- launcher


def test_launcher_missing_and_bad_config(tmp_path, capsys):
    assert launch.main(["--config", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err
    assert launch.main(["--training.steps", "3"]) == 2
    assert "missing --config" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    assert launch.main(["--config", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert launch.main(["--config", str(tmp_path)]) == 2  # a directory is not a config file
    assert launch.main(["--config", "tiny_cpu", "--nproc", "0"]) == 2
    assert "--nproc" in capsys.readouterr().err
    assert launch.main(["--help"]) == 0
    assert "tiny_cpu" in capsys.readouterr().out


def test_launcher_command(tmp_path):
    assert launch.resolve_config("tiny_cpu") == TINY == launch.resolve_config("tiny_cpu.toml")
    cmd = launch.build_command(TINY, {}, 2, ["--training.steps", "3"])
    assert cmd[:3] == [launch.sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cmd and cmd[cmd.index("-m", 3) + 1] == launch.ENTRY_MODULE
    joined = " ".join(cmd)
    assert f"--experimental.custom_import {launch.CUSTOM_IMPORT}" in joined
    assert f"--job.custom_config_module {launch.CONFIG_MODULE}" in joined
    assert cmd[-2:] == ["--training.steps", "3"]
    # set by the TOML or by an override: left alone
    toml = {"experimental": {"custom_import": "mine"}, "job": {"custom_config_module": "my.config"}}
    assert "--experimental.custom_import" not in launch.build_command(TINY, toml, 1, [])
    assert "--job.custom_config_module" not in launch.build_command(TINY, toml, 1, [])
    cmd = launch.build_command(TINY, {}, 1, ["--experimental.custom_import=mine"])
    assert cmd.count("--experimental.custom_import") == 0 and cmd[-1] == "--experimental.custom_import=mine"
    assert launch.CHILD_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
