"""`titan-megamoe train`: run TorchTitan 0.2.2's trainer with titan-megamoe loaded, on GPUs or CPU.

    titan-megamoe train --config X.toml [--nproc N] [TorchTitan overrides ...]

--config takes a TOML path, or the name of a config shipped in the package (`tiny_cpu`,
`qwen3_moe_debug`, ...; see `titan_megamoe/configs/`). The launcher adds
`--experimental.custom_import titan_megamoe.integrations.torchtitan` and
`--job.custom_config_module titan_megamoe.integrations.torchtitan.config` unless the TOML or the
overrides set them, then starts `torch.distributed.run` (torchrun, standalone rendezvous) with N
processes of `python -m titan_megamoe.integrations.torchtitan.entry` (default N: the number of CUDA
devices, or 1 without CUDA; NCCL on GPUs, gloo on CPU). Only rank 0's output is shown (a failure on
another rank still ends the job and torchrun prints its traceback). Its exit status is the trainer's.
Everything after the launcher's own options goes to TorchTitan unchanged, e.g.
`--training.steps 20 --mega_moe.enable --metrics.log_freq 1`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from .assets import CONFIGS_DIR

CUSTOM_IMPORT = "titan_megamoe.integrations.torchtitan"
CONFIG_MODULE = "titan_megamoe.integrations.torchtitan.config"
ENTRY_MODULE = "titan_megamoe.integrations.torchtitan.entry"
# keep NVLink multicast off: on shared hosts a program using it can take the GPUs out of service
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

USAGE = """usage: titan-megamoe train --config X.toml [--nproc N] [TorchTitan overrides ...]

  --config X   TOML file, or a bundled config name: {names}
  --nproc N    trainer processes on this host (default: CUDA device count, or 1 on CPU)
  overrides    any TorchTitan 0.2.2 flag, e.g. --training.steps 20 --mega_moe.enable --metrics.log_freq 1

All TorchTitan options, including [mega_moe]:
  python -m torchtitan.config.manager --job.custom_config_module {config_module} --help
"""


def _usage() -> str:
    names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))) or "(none)"
    return USAGE.format(names=names, config_module=CONFIG_MODULE)


def _err(msg: str) -> int:
    print(f"titan-megamoe train: {msg}", file=sys.stderr)
    return 2


def resolve_config(value: str) -> Path | None:
    """A path as given, else a bundled config by name (with or without .toml)."""
    p = Path(value).expanduser()
    if p.is_file():
        return p.resolve()
    name = p.name if p.suffix == ".toml" else p.name + ".toml"
    if p.parent == Path("."):
        bundled = CONFIGS_DIR / name
        if bundled.is_file():
            return bundled
    return None


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str], str | None]:
    """Remove `--name V` / `--name=V` from argv: (value, rest, error)."""
    value, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == name:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                return None, argv, f"{name} needs a value"
            value = argv[i + 1]
            i += 2
            continue
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
            i += 1
            continue
        rest.append(a)
        i += 1
    return value, rest, None


def _is_set(overrides: list[str], toml: dict, section: str, key: str) -> bool:
    flags = {f"--{section}.{key}", f"--{section}.{key.replace('_', '-')}"}
    if any(a.split("=", 1)[0] in flags for a in overrides):
        return True
    table = toml.get(section)
    return isinstance(table, dict) and bool(table.get(key))


def build_command(config: Path, toml: dict, nproc: int, overrides: list[str]) -> list[str]:
    args = ["--job.config_file", str(config)]
    if not _is_set(overrides, toml, "experimental", "custom_import"):
        args += ["--experimental.custom_import", CUSTOM_IMPORT]
    if not _is_set(overrides, toml, "job", "custom_config_module"):
        args += ["--job.custom_config_module", CONFIG_MODULE]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "--local-ranks-filter=0",  # rank 0's log only, like TorchTitan's run_train.sh
        "-m", ENTRY_MODULE, *args, *overrides,
    ]


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def main(argv: list[str]) -> int:
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(_usage())
        return 0
    config_arg, argv, err = _take_option(argv, "--config")
    if err:
        return _err(err)
    nproc_arg, overrides, err = _take_option(argv, "--nproc")
    if err:
        return _err(err)
    if config_arg is None:
        return _err("missing --config X.toml\n\n" + _usage())
    if any(a.split("=", 1)[0] in ("--job.config_file", "--job.config-file") for a in overrides):
        return _err("give the config with --config, not --job.config_file")

    config = resolve_config(config_arg)
    if config is None:
        return _err(f"config file {config_arg!r} not found (not a file, nor a bundled config); "
                    f"bundled configs: {', '.join(sorted(p.stem for p in CONFIGS_DIR.glob('*.toml')))}")
    try:
        with open(config, "rb") as f:
            toml = tomllib.load(f)
    except OSError as e:
        return _err(f"cannot read config file {str(config)!r}: {e.strerror or e}")
    except tomllib.TOMLDecodeError as e:
        return _err(f"config file {str(config)!r} is not valid TOML: {e}")

    if nproc_arg is None:
        nproc = default_nproc()
    else:
        try:
            nproc = int(nproc_arg)
        except ValueError:
            nproc = 0
        if nproc < 1:
            return _err(f"--nproc must be a positive integer, got {nproc_arg!r}")

    cmd = build_command(config, toml, nproc, overrides)
    env = {**os.environ, **CHILD_ENV}
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130
