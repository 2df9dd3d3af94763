"""A/B config handling: bundled-config lookup, TOML + CLI overrides, the activation-checkpointing line."""


import pytest

from titan_megamoe.ab import config as cfg

TOML = """
[model]
name = "qwen3"
flavor = "tiny"
[training]
local_batch_size = 2
seq_len = 64
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def test_parse_overrides_forms():
    got = cfg.parse_overrides([
        "--training.seq_len", "128", "--debug.deterministic", "--compile.enable", "--optimizer.name=AdamW",
        "--model.converters", "quantize.linear.float8,quantize.grouped_mm.float8",
        "--debug.no-deterministic_warn_only", "--lr_scheduler.warmup-steps", "2", "--optimizer.lr", "3e-4",
        "--parallelism.data_parallel_shard_degree", "-1",
    ])
    assert got == [
        ("training.seq_len", 128), ("debug.deterministic", True), ("compile.enable", True), ("optimizer.name", "AdamW"),
        ("model.converters", "quantize.linear.float8,quantize.grouped_mm.float8"),
        ("debug.deterministic_warn_only", False), ("lr_scheduler.warmup_steps", 2), ("optimizer.lr", 3e-4),
        ("parallelism.data_parallel_shard_degree", -1),
    ]
    with pytest.raises(cfg.ConfigError, match="expected --section.key"):
        cfg.parse_overrides(["training.steps", "3"])


@pytest.mark.parametrize("args", [["--mega_moe.enable", "false"], ["--compile.enable=true"],
                                  ["--debug.deterministic", "True"]])
def test_a_value_given_to_a_bool_flag_names_the_flag_spelling(args):
    """TorchTitan's CLI (tyro) rejects `--compile.enable=true` and `--mega_moe.enable false` with "Unrecognized
    options: true" (checked against TorchTitan 0.2.2's ConfigManager); ours names the option and both flags."""
    key = args[0][2:].split("=")[0]
    section, _, leaf = key.rpartition(".")
    with pytest.raises(cfg.FlagValueError, match=f"write --{key} for true, --{section}.no-{leaf} for false"):
        cfg.parse_overrides(["--training.steps", "3", *args])


def test_true_and_false_stay_values_of_options_that_are_not_bools():
    """`--job.description true` is a string option's value (TorchTitan 0.2.2 parses it): only bool options'
    values are the flag mistake."""
    assert cfg.parse_overrides(["--job.description", "true", "--activation_checkpoint.selective_ac_option=false"]) == [
        ("job.description", True), ("activation_checkpoint.selective_ac_option", False)]


def test_the_bool_option_list_is_torchtitans():
    """The launcher knows TorchTitan's bool options without importing TorchTitan; they must be JobConfig's."""
    import dataclasses
    import typing

    from titan_megamoe.integrations.torchtitan.config import JobConfig as OurJobConfig
    from torchtitan.config import JobConfig

    def bools(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from bools(hints[f.name], f"{prefix}{f.name}.")
            elif hints[f.name] is bool:
                yield prefix + f.name

    assert cfg.TORCHTITAN_BOOL_OPTIONS == set(bools(JobConfig))
    assert cfg.bool_options() == set(bools(JobConfig)) | set(bools(OurJobConfig))


def test_load_config_applies_overrides(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text(TOML)
    values = cfg.load_config(path, ["--training.seq_len", "128", "--quantize.linear.float8.recipe_name", "rowwise"])
    assert values["training"] == {"local_batch_size": 2, "seq_len": 128}
    assert values["quantize"]["linear"]["float8"]["recipe_name"] == "rowwise"
    assert cfg.lookup(values, "model.name") == "qwen3" and cfg.lookup(values, "nope.x", 5) == 5
    # TorchTitan's own default where the TOML is silent
    assert cfg.setting(values, "parallelism.tensor_parallel_degree") == 1


def test_bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training\n")
    with pytest.raises(cfg.ConfigError, match="not valid TOML"):
        cfg.load_config(path, [])


def test_resolve_config_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(TOML)
    assert cfg.resolve_config_path(str(path)) == path.resolve()
    with pytest.raises(cfg.ConfigError, match="not found"):
        cfg.resolve_config_path(str(tmp_path / "missing.toml"))
    with pytest.raises(cfg.ConfigError, match="bundled"):
        cfg.resolve_config_path("no_such_bundled_config.toml")


def test_bundled_default_config():
    if cfg.DEFAULT_CONFIG not in cfg.bundled_configs():
        pytest.skip("bundled configs not present in this checkout yet")
    path = cfg.resolve_config_path(None)
    assert path.name == cfg.DEFAULT_CONFIG and path.is_file()
    assert cfg.resolve_config_path(cfg.DEFAULT_CONFIG.removesuffix(".toml")) == path


@pytest.mark.parametrize(
    "mode, option, mega, save, expect",
    [
        ("none", None, False, None, "no AC"),
        ("full", None, True, None, "full AC"),
        ("selective", "2", False, None, "every 2 layer"),
        ("selective", "op", False, None, "grouped_mm recomputed"),
        ("selective", "op", True, False, "fused MoE op recomputed"),
        ("selective", "op", True, True, "fused MoE op saved"),
    ],
)
def test_describe_ac(mode, option, mega, save, expect):
    text = cfg.describe_ac(mode, option, "qwen3", mega, save)
    assert expect in text
    if option == "op":
        assert "saves mm (every 2nd" in text and "SDPA" in text


def test_arm_settings(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text(TOML)
    values = cfg.load_config(path, ["--mega_moe.save_under_sac"])
    stock, mega = cfg.arm_settings(values, False), cfg.arm_settings(values, True)
    assert stock["mega_moe.save_under_sac"] is None and "grouped_mm recomputed" in stock["ac_saves"]
    assert mega["mega_moe.save_under_sac"] is True and "fused MoE op saved" in mega["ac_saves"]
    assert stock["local_batch_size"] == 2 and stock["model"] == "qwen3 tiny"
