"""scripts/build_wheelhouse.py without the network: the dry-run plan, options, and the fetch path with pip faked."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_wheelhouse.py"


@pytest.fixture
def wh(monkeypatch):
    spec = importlib.util.spec_from_file_location("build_wheelhouse", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)

    def no_subprocess(*a, **k):
        raise AssertionError(f"unexpected subprocess call: {a}")

    monkeypatch.setattr(mod.subprocess, "run", no_subprocess)
    return mod


def test_dry_run_lists_plan_without_network(wh, tmp_path, capsys):
    out = tmp_path / "whl"
    assert wh.main(["--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for pin in wh.PINS:
        assert pin.spec in text
    assert f"titan-megamoe=={wh.own_version()}" in text
    for platform in wh.PLATFORMS:
        assert f"--platform {platform}" in text
    assert "--python-version 3.12" in text and "--only-binary=:all:" in text and "--no-deps" in text
    assert f"python3 -m pip install --no-index --find-links {out} titan-megamoe" in text
    assert "--no-deps" in text and "--target" in text
    assert not out.exists()


def test_extra_overrides_and_adds_skip_removes(wh, capsys):
    argv = ["--dry-run", "--extra", "torchao==0.18.0", "--extra", "einops==0.8.1", "--skip", "shtab",
            "--skip", "titan-megamoe", "--python-version", "3.11"]
    assert wh.main(argv) == 0
    text = capsys.readouterr().out
    plan = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("["))
    assert "torchao==0.18.0" in plan and "torchao==0.16.0" not in plan
    assert "overrides torchao==0.16.0 with torchao==0.18.0" in text
    assert "einops==0.8.1" in plan
    assert "shtab" not in plan and "titan-megamoe==" not in plan
    assert "--python-version 3.11" in text


@pytest.mark.parametrize("argv", [["--extra", "einops"], ["--extra", "==1.0"], ["--python-version", "312"]])
def test_bad_arguments_are_usage_errors(wh, argv, capsys):
    with pytest.raises(SystemExit) as err:
        wh.main(["--dry-run", *argv])
    assert err.value.code == 2


def _fake_wheel(path: Path, name: str, version: str, requires: list[str]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        meta += [f"Requires-Dist: {r}" for r in requires]
        zf.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(meta) + "\n\nbody\n")


def _fake_pip(missing: set[str]):
    """Stands in for `pip wheel` / `pip download`: writes a small wheel into --dest, or fails for `missing`."""

    def run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("--dest" if "download" in cmd else "--wheel-dir") + 1])
        if "wheel" in cmd:
            name, version, requires = "titan_megamoe", "0.1.0", ["torch>=2.11", "torchtitan==0.2.2"]
        else:
            name, _, version = cmd[-1].partition("==")
            if name in missing:
                return subprocess.CompletedProcess(cmd, 1, "", f"ERROR: No matching distribution found for {cmd[-1]}")
            requires = ["dill<0.4.0", 'colorama; sys_platform == "win32"'] if name == "datasets" else []
        _fake_wheel(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", name, version, requires)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_fetch_writes_requirements_and_reports_closure(wh, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wh.subprocess, "run", _fake_pip(missing=set()))
    out = tmp_path / "whl"
    assert wh.main(["--out", str(out)]) == 0
    text = capsys.readouterr().out
    reqs = (out / "requirements.txt").read_text().splitlines()
    pins = [line for line in reqs if not line.startswith("#")]
    assert pins == [f"titan-megamoe=={wh.own_version()}"] + [p.spec for p in wh.PINS]
    assert "summary:" in text and "total, 12 wheels" in text
    assert "torch" in text.split("must already have them")[1]  # titan-megamoe needs torch; not bundled
    assert "colorama" not in text  # win32-only requirement skipped
    assert "datasets requires dill<0.4.0, the wheelhouse has dill==0.4.0" in text  # conflicts are flagged
    assert f"--find-links {out} titan-megamoe" in text


def test_missing_wheel_names_package_and_platform_tags(wh, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wh.subprocess, "run", _fake_pip(missing={"torchao"}))
    out = tmp_path / "whl"
    assert wh.main(["--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "NOT FOUND: torchao==0.16.0" in captured.out
    assert "torchao==0.16.0: no wheel for CPython 3.12" in captured.err
    for platform in wh.PLATFORMS:
        assert platform in captured.err
    assert not (out / "requirements.txt").exists()
