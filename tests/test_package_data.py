"""The installed package carries every data file the code reads (pyproject's package-data).

A wheel built before 2026-12-05 lacked kernels/tuned_configs.json: an installed titan-megamoe then ran every
shape on the default tiles without a word. The checkout (editable installs, the device runs) had it."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "titan_megamoe"


def test_every_data_file_in_the_package_is_declared_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["titan_megamoe"]
    declared = {Path(p) for pat in patterns for p in glob.glob(pat, root_dir=PKG, recursive=True)
                if (PKG / p).is_file()}
    data = {p.relative_to(PKG) for p in PKG.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    assert Path("kernels/tuned_configs.json") in data
    assert data <= declared, f"not in [tool.setuptools.package-data]: {sorted(map(str, data - declared))}"


def test_a_missing_tile_table_stops_with_the_fix(monkeypatch, tmp_path):
    from titan_megamoe.kernels import configs

    monkeypatch.setattr(configs, "TABLE_PATH", tmp_path / "tuned_configs.json")
    configs._tuned_table.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="tuned_configs.json is missing from this install; reinstall"):
            configs._tuned_table()
    finally:
        monkeypatch.undo()
        configs._tuned_table.cache_clear()
