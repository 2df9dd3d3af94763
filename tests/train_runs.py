"""`titan-megamoe train` runs for the end-to-end tests (tests/test_torchtitan_train*.py): run one on the
bundled tiny config, parse its metric lines, read its checkpoints."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

STEP_RE = re.compile(r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+\d.naif]+)\s+grad_norm:\s*(?P<gnorm>[-+\d.naif]+)")
SEED = ("--debug.seed", "42", "--debug.deterministic")


@dataclass
class Run:
    returncode: int
    log: str
    steps: dict[int, tuple[float, float]]  # step -> (loss, grad_norm), as printed by rank 0
    dump: Path

    def losses(self) -> list[float]:
        return [self.steps[s][0] for s in sorted(self.steps)]


def train(dump: Path, *overrides: str, nproc: int = 1, config: str = "tiny_cpu", check: bool = True) -> Run:
    cmd = [sys.executable, "-m", "titan_megamoe.cli", "train", "--config", config, "--nproc", str(nproc),
           "--job.dump_folder", str(dump), *SEED, *overrides]
    # run from an unrelated directory: the bundled config, tokenizer and data must not depend on the cwd
    p = subprocess.run(cmd, cwd=dump.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    steps: dict[int, tuple[float, float]] = {}
    for m in STEP_RE.finditer(p.stdout):
        step = int(m["step"])
        assert step not in steps, f"step {step} logged twice:\n{p.stdout[-3000:]}"
        steps[step] = (float(m["loss"]), float(m["gnorm"]))
    run = Run(p.returncode, p.stdout, steps, dump)
    if check:
        assert p.returncode == 0, f"exit {p.returncode}:\n{p.stdout[-6000:]}"
        assert all(math.isfinite(v) for s in steps.values() for v in s)
    return run


def swap_line(log: str) -> str | None:
    m = re.search(r"\[mega_moe\] swapped .*", log)
    return m.group(0) if m else None


def flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def ckpt_tensors(step_dir: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(out, weights_only=False)
