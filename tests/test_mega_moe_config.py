"""`[mega_moe]` values checked at parse (TOML and CLI, enabled or not); what `titan-megamoe train` checks
before it starts torchrun, and the one line it ends a failed job with."""

from __future__ import annotations

import sys

import pytest
import torch

from titan_megamoe.integrations import launch
from titan_megamoe.integrations.mega_moe_section import MegaMoEConfigError, check_job_section, check_section
from titan_megamoe.integrations.failure import first_error
from torchtitan.config import ConfigManager

HEADER = '[job]\ncustom_config_module = "titan_megamoe.integrations.torchtitan.config"\n[mega_moe]\n'
VALID_KEYS = ("enable, precision, backend, fused_router, save_under_sac, ep_transport, ep_capacity_factor, "
              "tile_table")

BAD_TABLES = [  # (TOML lines under [mega_moe], words the error must contain)
    ('enable = "false"', ["enable", "bool", "'false'", "enable = false"]),  # a truthy string: was ON
    ('enable = "yes"', ["enable", "bool", "'yes'"]),
    ("enable = 1", ["enable", "bool", "int 1"]),
    ('fused_router = "true"', ["fused_router", "bool"]),
    ('save_under_sac = "no"', ["save_under_sac", "bool"]),
    ('backend = "cuda"', ["backend", '"auto", "reference", "triton"', "'cuda'"]),  # enable is false here
    ('enable = false\nprecision = "fp16"', ["precision", '"bf16"', "'fp16'"]),
    ("precision = 8", ["precision", "int 8"]),
    ('precison = "bf16"', ["unknown key 'precison'", "did you mean 'precision'", VALID_KEYS]),
    ("turbo = true", ["unknown key 'turbo'", VALID_KEYS]),
    ("tile_table = 3", ["tile_table", "file path string", "int 3"]),
    ("ep_capacity_factor = 0.5", ["ep_capacity_factor", "0 or a number >= 1", "float 0.5"]),
    ('ep_capacity_factor = "2"', ["ep_capacity_factor", "str '2'"]),
]


@pytest.mark.parametrize("lines, words", BAD_TABLES, ids=[b[0] for b in BAD_TABLES])
def test_bad_toml_values_fail_at_parse(tmp_path, lines, words):
    toml = tmp_path / "job.toml"
    toml.write_text(HEADER + lines + "\n")
    with pytest.raises(MegaMoEConfigError) as e:
        ConfigManager().parse_args(["--job.config_file", str(toml)])
    msg = str(e.value)
    assert msg.startswith("[mega_moe] ") and "run_train.sh" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_good_toml_values_parse(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(HEADER + 'enable = false\nprecision = "mxfp8"\nbackend = "reference"\nfused_router = false\n')
    c = ConfigManager().parse_args(["--job.config_file", str(toml)])
    assert (c.mega_moe.enable, c.mega_moe.precision, c.mega_moe.backend, c.mega_moe.fused_router) == (
        False, "mxfp8", "reference", False)


@pytest.mark.parametrize("flag, value", [("--mega_moe.backend", "cuda"), ("--mega_moe.precision", "fp16")])
def test_bad_cli_values_fail_at_parse(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        ConfigManager().parse_args(["--job.custom_config_module", launch.CONFIG_MODULE, flag, value])
    assert e.value.code != 0
    assert f"got '{value}'" in capsys.readouterr().err  # tyro shows our message


def test_check_section_direct():
    check_section({"enable": True, "precision": "bf16", "backend": "auto"})
    with pytest.raises(MegaMoEConfigError, match="enable must be a bool"):
        check_section({"enable": "true"})


# ---------------------------------------------------------------- titan-megamoe train, before torchrun starts


@pytest.fixture
def no_launch(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("torchrun must not start for a bad config")

    monkeypatch.setattr(launch.subprocess, "Popen", fail)


@pytest.mark.parametrize("overrides, words", [
    (["--training.steps", "-1"], ["training.steps", "-1", "--training.steps N"]),
    (["--training.steps", "0"], ["training.steps", "nothing would be trained"]),
    (["--mega_moe.backend", "cuda"], ["backend", "'cuda'"]),
    (["--mega-moe.enable", "yes"], ["take no value", "--mega-moe.no-enable for false"]),
])
def test_launcher_rejects_before_launch(no_launch, capsys, overrides, words):
    assert launch.main(["--config", "tiny_cpu", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("titan-megamoe train: "), err
    for w in words:
        assert w in err, (w, err)


CPU_HOST_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host backend='triton' can run")


@pytest.mark.parametrize("overrides, words", [
    pytest.param(["--mega_moe.enable", "--mega_moe.backend", "triton"],
                 ['backend = "triton" needs a CUDA GPU', "--mega_moe.backend auto"], marks=CPU_HOST_ONLY),
    (["--mega_moe.enable", "--mega_moe.precision", "mxfp8"], ["needs a Blackwell GPU", "--mega_moe.precision bf16"]),
    (["--mega_moe.enable", "--mega_moe.tile_table", "no_such_table.json"], ["tile_table", "does not exist"]),
    (["--mega_moe.enable", "false"], ["take no value", "--mega_moe.no-enable for false"]),
    (["--compile.enable=true"], ["take no value", "--compile.enable for true"]),
])
def test_launcher_rejects_what_this_machine_cannot_run(no_launch, capsys, monkeypatch, overrides, words):
    """Before torchrun starts (where each became ~130 lines: a traceback per rank and torchrun's own): a precision
    or backend this machine cannot run, a missing tile table, a value given to a bool flag."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert launch.main(["--config", "tiny_cpu", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("titan-megamoe train: "), err
    for w in words:
        assert w in err, (w, err)


@CPU_HOST_ONLY
def test_only_an_enabled_section_is_checked_against_the_machine(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_job_section({"backend": "triton", "tile_table": "no_such_table.json"})  # enable defaults to false
    with pytest.raises(MegaMoEConfigError, match="needs a CUDA GPU"):
        check_job_section({"backend": "triton"}, enabled=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs the kernels on the CPU
    check_job_section({"backend": "triton"}, enabled=True)


def test_launcher_rejects_bad_toml_table(no_launch, tmp_path, capsys):
    toml = tmp_path / "job.toml"
    toml.write_text(HEADER + 'precison = "bf16"\n')
    assert launch.main(["--config", str(toml)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean 'precision'" in err and VALID_KEYS in err


# ---------------------------------------------------------------- the failed job's last line

RANK_FAILURE = r'''
import sys
print("[titan] starting", flush=True)
print("[rank0]: Traceback (most recent call last):")
print('[rank0]:   File "x.py", line 1, in <module>')
print("[rank0]: ValueError: [mega_moe] precision='mxfp8' needs a Blackwell GPU; use precision='bf16'")
print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
for i in range(100):
    print(f"  noise {i}")
sys.exit(1)
'''


def test_failed_job_ends_with_its_cause(tmp_path, capfd):
    log = tmp_path / "dump" / launch.LOG_NAME
    rc = launch.run_logged([sys.executable, "-c", RANK_FAILURE], env=None, log_path=log)
    out, err = capfd.readouterr()
    assert rc == 1
    assert "noise 99" in out and "noise 99" in log.read_text()  # everything shown and kept
    last = err.strip().splitlines()[-1]
    assert last == (f"titan-megamoe train: failed (exit 1): [mega_moe] precision='mxfp8' needs a Blackwell GPU; "
                    f"use precision='bf16'  [full log: {log}]")


def test_log_goes_to_the_dump_folder(tmp_path):
    values = launch.resolved_values({"job": {"dump_folder": "from_toml"}}, ["--job.dump_folder", str(tmp_path)])
    assert launch.log_path_for(values) == tmp_path / launch.LOG_NAME
    assert launch.log_path_for({}).name == launch.LOG_NAME


def test_first_error_forms():
    assert first_error("a\n[rank0]: RuntimeError: boom\nChildFailedError: x\n") == "RuntimeError: boom"
    assert first_error("ok\nno errors here\n") is None
    box = ("╭─ Unrecognized options ─────╮\n│ Unrecognized options: --training.stpes, 3 │\n│ ────── │\n"
           "│ Perhaps you meant:          │\n│     --training.steps INT    │\n╰────────────╯\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert first_error(box) == "Unrecognized options: --training.stpes, 3; perhaps you meant --training.steps INT"
