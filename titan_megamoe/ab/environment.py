"""Record where an A/B ran: versions, git commit, date, host, device."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

PACKAGES = ("torch", "triton", "torchtitan", "torchao", "titan-megamoe")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(where: Path | None = None) -> dict | None:
    """HEAD of the checkout holding this package (editable installs), with a dirty flag.

    TITAN_MEGAMOE_COMMIT overrides it, for machines that receive a copy of the working tree whose .git
    is not the one the code came from (the result then says the commit was given, not read)."""
    given = os.environ.get("TITAN_MEGAMOE_COMMIT")
    if given:
        return {"commit": given, "dirty": None, "repo": "given by TITAN_MEGAMOE_COMMIT"}
    where = where or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty, "repo": str(where)}


def device_from_torch() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the record is best effort
        pass
    return f"cpu ({platform.processor() or platform.machine()})"


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(run_info: dict | None = None) -> dict:
    """`run_info` is what the training log said (device name); torch is asked only when the log did not."""
    run_info = run_info or {}
    device = run_info.get("device_name") or device_from_torch()
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": package_versions(),
        "git": git_commit(),
        "device": device,
        "device_source": "training log" if run_info.get("device_name") else "torch in the A/B process",
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "peak_flops_for_mfu": run_info.get("peak_flops"),
    }
