#!/usr/bin/env python3
"""Build an offline wheelhouse for installing titan-megamoe on an air-gapped GPU cluster.

Run on a machine with PyPI access (any OS: pip downloads by platform tag, nothing is installed here):

    python3 scripts/build_wheelhouse.py --out .whl

It builds titan-megamoe's own wheel (`pip wheel --no-deps`) and downloads (`pip download --no-deps
--only-binary=:all:`) the pinned non-torch dependency set below for CPython 3.12 on manylinux x86_64. It
assumes the cluster image already has torch, triton, numpy and the usual scientific stack; after the
downloads it lists every requirement of the fetched wheels that the wheelhouse does not hold (those must
be on the image, or be added with --extra NAME==VERSION). It writes DIR/requirements.txt and prints the
offline install commands. `--dry-run` prints the plan and touches neither the network nor the disk.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
OWN_NAME = "titan-megamoe"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEFAULT_PYTHON = "3.12"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    why: str = ""

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


# The non-torch set that runs TorchTitan 0.2.2 on the GPU box, plus what titan-megamoe itself needs and a
# torch image may lack. Versions without a GPU-box record are the ones the CPU dev/CI machines run.
PINS = (
    Pin("torchtitan", "0.2.2", "the trainer titan-megamoe extends"),
    Pin("tyro", "1.0.17", "torchtitan config/CLI parser"),
    Pin("docstring-parser", "0.18.0", "tyro"),
    Pin("typeguard", "4.6.1", "tyro"),
    Pin("shtab", "1.13.0", "tyro shell completion (optional there)"),
    Pin("torchdata", "0.11.0", "torchtitan dataloader"),
    Pin("datasets", "4.7.0", "torchtitan datasets"),
    Pin("dill", "0.4.0", "datasets"),
    Pin("multiprocess", "0.70.18", "datasets"),
    Pin("tomli", "2.5.0", "titan-megamoe / torchtitan TOML parsing"),
    # 0.16.0: abi3 manylinux_2_28 wheel (installs on 3.12); last release with
    # torchao.prototype.moe_training.conversion_utils.MoETrainingConfig, which 0.2.2's float8 MoE converter imports.
    Pin("torchao", "0.16.0", "torchtitan float8 converters"),
)


def canonical(name: str) -> str:
    """PEP 503 name normalization: `Docstring_Parser` and `docstring-parser` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pin(text: str) -> Pin:
    name, sep, version = text.partition("==")
    if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()) or not version.strip():
        raise argparse.ArgumentTypeError(f"expected NAME==VERSION (e.g. einops==0.8.1), got {text!r}")
    return Pin(name.strip(), version.strip(), "--extra")


def parse_python_version(text: str) -> str:
    if not re.fullmatch(r"3\.\d+", text):
        raise argparse.ArgumentTypeError(f"expected a CPython version like 3.12, got {text!r}")
    return text


def own_version() -> str:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def build_plan(extras: list[Pin], skips: list[str]) -> tuple[list[Pin], list[str]]:
    """Default pins, overridden or extended by --extra, minus --skip. Returns (pins, notes)."""
    plan = {canonical(p.name): p for p in PINS}
    notes = []
    for extra in extras:
        key = canonical(extra.name)
        if key in plan and plan[key].version != extra.version:
            notes.append(f"--extra overrides {plan[key].spec} with {extra.spec}")
        plan[key] = extra
    known = set(plan) | {canonical(OWN_NAME)}
    for name in skips:
        if canonical(name) not in known:
            notes.append(f"--skip {name}: not in the plan, ignored")
        plan.pop(canonical(name), None)
    return list(plan.values()), notes


def wheel_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(REPO_ROOT)]


def download_command(pin: Pin, out: Path, python_version: str) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + ["--dest", str(out), pin.spec]


def find_wheel(out: Path, name: str, version: str) -> Path | None:
    """The wheel of name==version in out (wheel names: {dist}-{version}(-{build})?-{py}-{abi}-{plat}.whl)."""
    for path in sorted(out.glob("*.whl")):
        parts = path.name[: -len(".whl")].split("-")
        if len(parts) >= 5 and canonical(parts[0]) == canonical(name) and parts[1] == version:
            return path
    return None


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pip always vendors it
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def wheel_requirements(path: Path) -> list[str]:
    """Requires-Dist lines from a wheel's METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = zf.read(meta).decode("utf-8", "replace")
    headers = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in headers.splitlines() if line.startswith("Requires-Dist:")]


def check_closure(fetched: dict[str, tuple[str, Path]], python_version: str):
    """Split the fetched wheels' requirements into ones the image must provide and version conflicts."""
    Requirement, Version = _packaging()
    env = {"python_version": python_version, "python_full_version": python_version + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    needs_image: dict[str, set[str]] = {}
    conflicts = []
    for owner, (version, path) in fetched.items():
        for line in wheel_requirements(path):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            key = canonical(req.name)
            if key in fetched:
                have = fetched[key][0]
                if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                    conflicts.append(f"{owner} requires {line}, the wheelhouse has {key}=={have}")
            else:
                needs_image.setdefault(key, set()).add(owner)
    return needs_image, conflicts


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def install_instructions(out_text: str) -> str:
    return "\n".join([
        f"Offline install on the cluster (copy {out_text} there first):",
        f"  python3 -m pip install --no-index --find-links {out_text} titan-megamoe",
        "Images whose torch must not be touched (no dependency resolution, installs beside the image's packages):",
        f"  python3 -m pip install --no-index --no-deps --find-links {out_text} --target SITE_DIR "
        f"-r {out_text}/requirements.txt",
        "  export PYTHONPATH=SITE_DIR:$PYTHONPATH   # CLI: SITE_DIR/bin/titan-megamoe or python3 -m titan_megamoe.cli",
    ])


def run_pip(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def _tail(text: str, lines: int = 6) -> str:
    kept = [l for l in text.strip().splitlines() if "is ignored: it is neither a file nor a directory" not in l]
    return "\n".join("      " + l for l in kept[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build a wheelhouse to install titan-megamoe offline on an air-gapped GPU cluster "
                    "(CPython 3.12, manylinux x86_64, torch/triton/numpy already on the image).")
    parser.add_argument("--out", default=".whl", help="wheelhouse directory (default: .whl)")
    parser.add_argument("--python-version", type=parse_python_version, default=DEFAULT_PYTHON,
                        help=f"the cluster's CPython version (default: {DEFAULT_PYTHON})")
    parser.add_argument("--extra", type=parse_pin, action="append", default=[], metavar="NAME==VER",
                        help="add a wheel, or override a default pin's version (repeatable)")
    parser.add_argument("--skip", action="append", default=[], metavar="NAME",
                        help=f"leave a package out, e.g. one the image has ({OWN_NAME} skips our own wheel; repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; no network, nothing written")
    args = parser.parse_args(argv)

    out_text = args.out.rstrip("/") or "/"
    out = Path(args.out)
    pins, notes = build_plan(args.extra, args.skip)
    build_own = canonical(OWN_NAME) not in {canonical(s) for s in args.skip}
    version = own_version()
    total = len(pins) + int(build_own)
    tags = ", ".join(PLATFORMS)

    print(f"wheelhouse for CPython {args.python_version} (cp), platforms {tags}")
    print(f"  out: {out_text}   wheels: {total}")
    for note in notes:
        print(f"  note: {note}")

    if args.dry_run:
        print("plan (dry run: nothing downloaded, nothing written):")
        i = 0
        if build_own:
            i += 1
            print(f"  [{i:2d}/{total}] {OWN_NAME}=={version}  (this repo: {' '.join(wheel_command(out)[1:])})")
        for pin in pins:
            i += 1
            print(f"  [{i:2d}/{total}] {pin.spec}" + (f"  ({pin.why})" if pin.why else ""))
        placeholder = Pin("NAME", "VERSION")
        print(f"each wheel: {' '.join(download_command(placeholder, out, args.python_version))}")
        print(f"would write {out_text}/requirements.txt with {total} pins")
        print(install_instructions(out_text))
        return 0

    out.mkdir(parents=True, exist_ok=True)
    fetched: dict[str, tuple[str, Path]] = {}
    failures: list[str] = []
    i = 0
    if build_own:
        i += 1
        print(f"[{i:2d}/{total}] {OWN_NAME}=={version}  building from {REPO_ROOT} ...", flush=True)
        proc = run_pip(wheel_command(out))
        path = find_wheel(out, OWN_NAME, version)
        if proc.returncode != 0 or path is None:
            failures.append(f"{OWN_NAME}: `pip wheel --no-deps {REPO_ROOT}` failed (exit {proc.returncode})")
            print(f"        FAILED\n{_tail(proc.stderr or proc.stdout)}", flush=True)
        else:
            fetched[canonical(OWN_NAME)] = (version, path)
            print(f"        {path.name}  {human_size(path.stat().st_size)}", flush=True)
    for pin in pins:
        i += 1
        print(f"[{i:2d}/{total}] {pin.spec} ...", flush=True)
        proc = run_pip(download_command(pin, out, args.python_version))
        path = find_wheel(out, pin.name, pin.version)
        if proc.returncode != 0 or path is None:
            failures.append(f"{pin.spec}: no wheel for CPython {args.python_version} on any of {tags} "
                            f"(pip download exit {proc.returncode})")
            print(f"        NOT FOUND: {pin.spec} has no wheel for cp{args.python_version.replace('.', '')} "
                  f"with platform tags {tags} (or pure Python)\n{_tail(proc.stderr or proc.stdout)}", flush=True)
        else:
            fetched[canonical(pin.name)] = (pin.version, path)
            print(f"        {path.name}  {human_size(path.stat().st_size)}", flush=True)

    if failures:
        print(f"\nerror: {len(failures)} of {total} wheels could not be fetched:", file=sys.stderr)
        for f in failures:
            print(f"  - {f}", file=sys.stderr)
        print("Check the name and version on PyPI, pick another version with --extra NAME==VER, "
              "or leave it out with --skip NAME if the image has it.", file=sys.stderr)
        return 1

    req_path = out / "requirements.txt"
    lines = [f"# titan-megamoe offline wheelhouse: CPython {args.python_version}, {tags}",
             "# written by scripts/build_wheelhouse.py; torch, triton, numpy etc. come from the cluster image"]
    lines += [f"{OWN_NAME if key == canonical(OWN_NAME) else key}=={ver}" for key, (ver, _) in fetched.items()]
    req_path.write_text("\n".join(lines) + "\n")

    print("\nsummary:")
    total_bytes = 0
    for _, path in fetched.values():
        size = path.stat().st_size
        total_bytes += size
        print(f"  {human_size(size):>10}  {path.name}")
    print(f"  {human_size(total_bytes):>10}  total, {len(fetched)} wheels in {out_text}; wrote {req_path}")

    needs_image, conflicts = check_closure(fetched, args.python_version)
    if needs_image:
        print("\nnot in the wheelhouse, so the cluster image must already have them (else add --extra NAME==VER):")
        for name in sorted(needs_image):
            print(f"  {name:<20} needed by {', '.join(sorted(needs_image[name]))}")
    if conflicts:
        print("\nwarning: version conflicts inside the wheelhouse (pip install --no-index will refuse them):")
        for c in conflicts:
            print(f"  {c}")
    print()
    print(install_instructions(out_text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
