"""The `titan-megamoe` entry point itself: --version, usage."""

import re
import subprocess
import sys
from pathlib import Path

import titan_megamoe
from titan_megamoe import cli

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_flag(capsys):
    assert cli.main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"titan-megamoe {titan_megamoe.__version__} (torch ")
    assert "torchtitan 0.2.2" in line and "triton " in line and "torchao " in line


def test_version_matches_pyproject():
    declared = re.search(r'^version = "([^"]+)"', PYPROJECT.read_text(), re.M).group(1)
    assert titan_megamoe.__version__ == declared


def test_version_from_the_console_entry():
    p = subprocess.run([sys.executable, "-m", "titan_megamoe.cli", "--version"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("titan-megamoe "), p.stderr[-2000:]


def test_unknown_command(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    assert cli.main(["benchmark"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'benchmark'" in err and "did you mean" not in err


def test_the_launcher_does_not_import_torchtitan():
    """`titan-megamoe train` checks `[mega_moe]` and starts torchrun without importing TorchTitan (~4 s a launch
    on CPU when it did); the trainer processes import it."""
    code = ("import sys, titan_megamoe.cli, titan_megamoe.integrations.launch as l; "
            "l.check_before_launch({'mega_moe': {'enable': True}, 'training': {'steps': 1}}); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchtitan'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr[-2000:]
