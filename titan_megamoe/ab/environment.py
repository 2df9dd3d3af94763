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


PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the titan_megamoe package that is running


def _git(where: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def _head(repo: Path) -> dict | None:
    try:
        commit = _git(repo, "rev-parse", "HEAD")
        dirty = bool(_git(repo, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty, "repo": str(repo)}


def _same_files(installed: Path, checkout: Path) -> bool:
    """Every file of the installed package has the same bytes in the checkout's titan_megamoe/."""
    files = [p for p in installed.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    if not files:
        return False
    for p in files:
        twin = checkout / p.relative_to(installed)
        if not twin.is_file() or twin.read_bytes() != p.read_bytes():
            return False
    return True


def git_commit(package_dir: Path | None = None, cwd: Path | None = None) -> dict | None:
    """The commit of the code that runs, with a dirty flag; None when it cannot be known.

    An editable install runs from its checkout: that checkout's HEAD. A regular install (`pip install .`
    from a clone, as the README's quick start does) runs a copy in site-packages: the checkout in the
    current directory is recorded only if the copy is byte for byte its `titan_megamoe/`, so a stale
    install is never labelled with a newer commit. TITAN_MEGAMOE_COMMIT overrides both, for machines that
    receive a copy of the working tree whose .git is not the one the code came from (the result then says
    the commit was given, not read)."""
    given = os.environ.get("TITAN_MEGAMOE_COMMIT")
    if given:
        return {"commit": given, "dirty": None, "repo": "given by TITAN_MEGAMOE_COMMIT"}
    package_dir = (package_dir or PACKAGE_DIR).resolve()
    try:
        top = Path(_git(package_dir, "rev-parse", "--show-toplevel"))
        if package_dir == top / package_dir.name:
            return _head(top)
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        top = Path(_git(cwd or Path.cwd(), "rev-parse", "--show-toplevel"))
    except (OSError, subprocess.SubprocessError):
        return None
    if not _same_files(package_dir, top / package_dir.name):
        return None
    head = _head(top)
    return {**head, "how": "installed copy identical to this checkout's files"} if head else None


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
