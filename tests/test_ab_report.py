"""The A/B report: CPU timing caveat, commit line, non-finite values in ab.json, the git commit it records."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from titan_megamoe.ab import environment, report


def record(device: str, speedup: float = 1.87, git=None) -> dict:
    summary = {"step_time_s": 0.5, "n_steps": 3, "n_timed_steps": 2, "final_loss": float("nan")}
    return {
        "config": "tiny_cpu.toml", "steps": 3, "warmup": 1, "nproc": 1, "seed": 42, "deterministic": True,
        "overrides": [], "arm_order": ["stock", "mega_moe"], "warnings": [],
        "arms": {a: {"ok": True, "summary": dict(summary), "settings": {"ac_saves": "no AC"}} for a in ("stock", "mega_moe")},
        "comparison": {"speedup": speedup, "ratios_mega_over_stock": {"step_time": 1 / speedup},
                       "loss_diff": {"n_steps": 3, "n_common_steps": 3, "max_abs": 0.0, "mean_abs": 0.0,
                                     "max_abs_step": 1}},
        "environment": {"device": device, "cpu": "Xeon", "cpu_count": 2, "versions": {}, "git": git,
                        "date": "d", "host": "h", "platform": "p", "python": "3", "device_source": "training log"},
    }


def test_cpu_table_says_step_times_are_not_meaningful():
    text = report.format_table(record("cpu (x86_64)"))
    assert "speedup (stock step time / mega_moe step time): 1.870x (CPU: not meaningful, see below)" in text
    assert text.rstrip().endswith(report.CPU_TIMING_NOTE)
    assert report.CPU_TIMING_NOTE in report.format_markdown(record("CPU"))
    gpu = report.format_table(record("NVIDIA H200"))
    assert "not meaningful" not in gpu and "CPU run" not in gpu


def test_commit_line():
    assert "commit n/a (not run from a git checkout" in report.format_table(record("NVIDIA H200"))
    text = report.format_table(record("NVIDIA H200", git={"commit": "0123456789abcdef", "dirty": True}))
    assert "commit 0123456789 (dirty)" in text


def test_non_finite_values_are_visible_in_json(tmp_path):
    r = record("CPU")
    r["arms"]["stock"]["summary"]["x"] = [float("inf"), -float("inf"), 1.0]
    report.write_json(r, tmp_path / "ab.json")
    back = json.loads((tmp_path / "ab.json").read_text())
    assert back["arms"]["stock"]["summary"]["final_loss"] == "nan"
    assert back["arms"]["stock"]["summary"]["x"] == ["inf", "-inf", 1.0]


# ---------------------------------------------------------------- the commit, from a checkout

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "clone"
    (repo / "titan_megamoe").mkdir(parents=True)
    (repo / "titan_megamoe" / "a.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    return repo


@needs_git
def test_commit_of_a_pip_installed_copy_read_from_the_checkout(checkout, tmp_path, monkeypatch):
    monkeypatch.delenv("TITAN_MEGAMOE_COMMIT", raising=False)
    installed = tmp_path / "site-packages" / "titan_megamoe"
    shutil.copytree(checkout / "titan_megamoe", installed)
    got = environment.git_commit(package_dir=installed, cwd=checkout)
    assert got["commit"] == git(checkout, "rev-parse", "HEAD") and got["dirty"] is False
    assert got["repo"] == str(checkout) and "identical" in got["how"]
    # an install that is not this checkout's code is not labelled with its commit
    (installed / "a.py").write_text("x = 2\n")
    assert environment.git_commit(package_dir=installed, cwd=checkout) is None
    assert environment.git_commit(package_dir=installed, cwd=tmp_path) is None  # no checkout at all


@needs_git
def test_commit_of_an_editable_install(checkout, monkeypatch):
    monkeypatch.delenv("TITAN_MEGAMOE_COMMIT", raising=False)
    (checkout / "titan_megamoe" / "a.py").write_text("x = 3\n")
    got = environment.git_commit(package_dir=checkout / "titan_megamoe", cwd=Path("/"))
    assert got["commit"] == git(checkout, "rev-parse", "HEAD") and got["dirty"] is True
    monkeypatch.setenv("TITAN_MEGAMOE_COMMIT", "abc")
    assert environment.git_commit()["commit"] == "abc"


# ---------------------------------------------------------------- ab.png


def test_plot_leaves_out_the_warm_up_and_titles_the_speedup(tmp_path):
    import matplotlib.pyplot as plt

    from titan_megamoe.ab import plot

    r = record("NVIDIA H200", speedup=1.327)
    r["warmup"] = 1
    for arm, offset in (("stock", 0.0), ("mega_moe", 0.01)):
        r["arms"][arm]["steps"] = [{"step": k, "loss": 8.0 - k + offset} for k in (1, 2, 3, 4)]
        r["arms"][arm]["summary"]["step_time_s_per_step"] = {"1": 17.0, "2": 0.5, "3": 0.52, "4": 0.49}
    r["comparison"]["loss_diff"]["per_step"] = {"1": 0.004, "2": 0.005, "3": float("nan"), "4": 0.006}
    fig = plot.build_figure(r)
    ax_loss, ax_time, ax_diff = fig.axes
    try:
        assert "speedup 1.327x (stock step time / mega_moe step time)" in ax_loss.get_title()
        assert ax_time.get_ylim()[1] < 1.0  # step 1's 17 s is not drawn: the timed steps fill the panel
        assert all(min(line.get_xdata()) == 2 for line in ax_time.get_lines())
        assert "step 1 of warm-up not shown" in ax_time.get_title()
        assert ax_diff.get_ylim()[0] == 0.0 and list(ax_diff.get_lines()[0].get_xdata()) == [1, 2, 4]
    finally:
        plt.close(fig)
    plot.plot_ab(r, tmp_path / "ab.png")
    assert (tmp_path / "ab.png").stat().st_size > 0
