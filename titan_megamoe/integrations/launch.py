"""`titan-megamoe train`: run TorchTitan 0.2.2's trainer with titan-megamoe loaded, on GPUs or CPU.

    titan-megamoe train --config X.toml [--nproc N] [TorchTitan overrides ...]

--config takes a TOML path, or the name of a config shipped in the package (`tiny_cpu`,
`qwen3_moe_debug`, ...; see `titan_megamoe/configs/`). The launcher adds
`--experimental.custom_import titan_megamoe.integrations.torchtitan` and
`--job.custom_config_module titan_megamoe.integrations.torchtitan.config` unless the TOML or the
overrides set them, then starts `torch.distributed.run` (torchrun, standalone rendezvous) with N
processes of `python -m titan_megamoe.integrations.torchtitan.entry` (default N: the number of CUDA
devices, or 1 without CUDA; NCCL on GPUs, gloo on CPU). Only rank 0's output is shown (a failure on
another rank still ends the job and torchrun prints its traceback). Once torchrun has started, the exit status
is torchrun's: 0 when every rank finished, non-zero (1) when one failed; before, 2 for a mistake caught here
(130 on Ctrl-C).
Everything after the launcher's own options goes to TorchTitan unchanged, e.g.
`--training.steps 20 --mega_moe.enable --metrics.log_freq 1`.

Before anything starts, the `[mega_moe]` values (TOML and overrides; with `enable`, also whether this
machine can run the precision and backend, and the tile table), `training.steps` and values given to bool
flags are checked, so such a mistake is one line, not a traceback per rank. The job's output is also written to
`<job.dump_folder>/titan-megamoe-train.log`; when the job fails, the last line on the screen says why (the
first error a rank raised) and where that log is.
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

from ..ab import config as ab_config
from .assets import CONFIGS_DIR
from .mega_moe_section import MegaMoEConfigError, check_job_section
from .failure import first_error

CUSTOM_IMPORT = "titan_megamoe.integrations.torchtitan"
CONFIG_MODULE = "titan_megamoe.integrations.torchtitan.config"
ENTRY_MODULE = "titan_megamoe.integrations.torchtitan.entry"
# keep NVLink multicast off: on shared hosts a program using it can take the GPUs out of service
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
LOG_NAME = "titan-megamoe-train.log"  # in job.dump_folder: the whole job's output, kept for a failure

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


def resolved_values(toml: dict, overrides: list[str]) -> dict | None:
    """TOML + overrides as nested values (TorchTitan's own parse decides later), None if they do not parse."""
    try:
        return ab_config.apply_overrides(toml, ab_config.parse_overrides(overrides))
    except ab_config.FlagValueError:
        raise  # a value given to a bool flag: TorchTitan's parser would only say "Unrecognized options"
    except ab_config.ConfigError:
        return None  # an unusual override spelling: TorchTitan's parser reports it


def check_mega_moe(values: dict, enabled: bool | None = None) -> str | None:
    """What is wrong with the job's `[mega_moe]` section (`check_job_section`; `enabled` overrides its `enable`),
    when the section is ours (the job uses our config module), else None."""
    section = values.get("mega_moe", {})
    module = ab_config.lookup(values, "job.custom_config_module") or CONFIG_MODULE
    if isinstance(section, dict) and module == CONFIG_MODULE:
        try:
            check_job_section(section, enabled)
        except MegaMoEConfigError as e:
            return str(e)
    return None


def check_before_launch(values: dict) -> str | None:
    """What would fail the job (or make it train nothing) that we can tell from the values alone."""
    problem = check_mega_moe(values)
    if problem:
        return problem
    steps = ab_config.setting(values, "training.steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        return (f"training.steps must be a positive integer (got {steps!r}: "
                f"{'nothing would be trained' if steps == 0 else 'the LR scheduler cannot use it'}); "
                f"set --training.steps N with N >= 1")
    return None


def log_path_for(values: dict | None) -> Path:
    dump = ab_config.setting(values or {}, "job.dump_folder") or "./outputs"
    return Path(str(dump)).expanduser() / LOG_NAME


def run_logged(cmd: list[str], env: dict, log_path: Path) -> int:
    """Run the job, its output on the screen and in `log_path`; end with the cause when it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached torchrun too (same process group): let it stop the ranks
            proc.wait()
            return 130
    sys.stdout.flush()
    if rc != 0:
        cause = first_error(log_path.read_text(errors="replace")) or "no error message found"
        print(f"titan-megamoe train: failed (exit {rc}): {cause}  [full log: {log_path}]", file=sys.stderr)
    return rc


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

    try:
        values = resolved_values(toml, overrides)
    except ab_config.FlagValueError as e:
        return _err(str(e))
    problem = check_before_launch(values) if values is not None else None
    if problem:
        return _err(problem)

    cmd = build_command(config, toml, nproc, overrides)
    env = {**os.environ, **CHILD_ENV}
    try:
        return run_logged(cmd, env, log_path_for(values))
    except OSError as e:
        return _err(f"cannot start or log the job: {e}")
