"""Run one arm of the A/B: the training command as a child process, its log teed to a file, one progress
line per step on the console. Ctrl-C (or SIGTERM to us) terminates the child's whole process group."""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .metrics import LogParser, StepMetrics


@dataclasses.dataclass
class ArmResult:
    name: str
    command: list[str]
    log_path: Path
    returncode: int | None = None  # None: never started or killed before exiting
    parser: LogParser = dataclasses.field(default_factory=LogParser)
    wall_s: float = 0.0
    interrupted: bool = False
    error: str | None = None  # why it could not start

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.parser.steps) and not self.interrupted

    @property
    def failure(self) -> str | None:
        if self.ok:
            return None
        if self.interrupted:
            return "interrupted"
        if self.error:
            return self.error
        if self.returncode != 0:
            return f"exit code {self.returncode}"
        return "no metric lines in the log"


def _step_seconds(parser: LogParser, step: StepMetrics) -> float | None:
    prev = parser.steps[-2].time if len(parser.steps) > 1 else parser.start_time
    if step.time is None or prev is None:
        return None
    return (step.time - prev).total_seconds()


def progress_line(name: str, step: StepMetrics, total_steps: int, seconds: float | None) -> str:
    pace = f"{seconds:.2f} s/step" if seconds is not None else "-"
    return f"[{name}] step {step.step}/{total_steps} loss {step.loss:.4f} {pace}"


def _terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the child's process group (torchrun and its workers), SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_arm(
    name: str,
    command: list[str],
    log_path: Path,
    total_steps: int,
    echo: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
) -> ArmResult:
    result = ArmResult(name=name, command=command, log_path=log_path)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    echo(f"[{name}] {shlex.join(command)}")
    echo(f"[{name}] log: {log_path}")
    t0 = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"# {shlex.join(command)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                bufsize=1,
                env=child_env,
                start_new_session=True,  # Ctrl-C reaches only us; we stop the child group ourselves
            )
        except OSError as e:
            result.error = f"could not start: {e}"
            log.write(result.error + "\n")
            return result
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                step = result.parser.feed(line)
                if step is not None:
                    log.flush()
                    echo(progress_line(name, step, total_steps, _step_seconds(result.parser, step)))
            result.returncode = proc.wait()
        except KeyboardInterrupt:
            result.interrupted = True
            echo(f"[{name}] interrupted: stopping the training process (pid {proc.pid})")
            _terminate(proc)
            result.returncode = proc.poll()
            log.write("\n# interrupted by the user (titan-megamoe ab)\n")
        finally:
            if proc.poll() is None:  # an exception other than Ctrl-C: never leave the child behind
                _terminate(proc)
    result.wall_s = time.perf_counter() - t0
    status = "ok" if result.ok else f"FAILED ({result.failure})"
    echo(f"[{name}] {status}: {len(result.parser.steps)} steps in {result.wall_s:.1f} s")
    return result


def python_module_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "titan_megamoe.cli", *args]
