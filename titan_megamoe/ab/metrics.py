"""Parse TorchTitan 0.2.2 training logs: per-step metric lines and the few run facts the A/B report needs.

The step line comes from `torchtitan/components/metrics.py: MetricsProcessor.log`:
    step: {step:2}  loss: {loss:8.5f}  grad_norm: {g:7.4f}  memory: {gib:5.2f}GiB({pct:.2f}%)
    tps: {round(tps):,}  tflops: {tflops:,.2f}  mfu: {mfu:.2f}%
behind the logger prefix `[titan] %(asctime)s - %(name)s - %(levelname)s - ` (asctime has millisecond
resolution). `tps` is tokens/s per device; tflops and mfu use the model's FLOPs per token. ANSI colour codes
are stripped, so logs with or without `--metrics.disable_color_printing` parse the same.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TIME_RE = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3})")
_NUM = r"[-+]?(?:[\d,]*\.?\d+(?:[eE][-+]?\d+)?|nan|inf)"
_STEP_RE = re.compile(
    r"(?<![A-Za-z_])(?<!validate )step:\s*(?P<step>\d+)\s+"
    rf"loss:\s*(?P<loss>{_NUM})\s+"
    rf"grad_norm:\s*(?P<grad_norm>{_NUM})\s+"
    rf"memory:\s*(?P<memory_gib>{_NUM})GiB\((?P<memory_pct>{_NUM})%\)\s+"
    rf"tps:\s*(?P<tps>{_NUM})\s+"
    rf"tflops:\s*(?P<tflops>{_NUM})\s+"
    rf"mfu:\s*(?P<mfu_pct>{_NUM})%",
    re.IGNORECASE,
)
_TRAINER_RE = re.compile(
    r"Trainer is initialized with local batch size (?P<local_batch_size>\d+), "
    r"global batch size (?P<global_batch_size>\d+), "
    r"gradient accumulation steps (?P<grad_accum_steps>\d+), "
    r"sequence length (?P<seq_len>\d+), total steps (?P<total_steps>\d+)"
)
_DEVICE_RE = re.compile(r"(?P<device_type>\w+) capacity: (?P<device_name>.*?) with (?P<gib>[\d.]+)GiB memory")
_PEAK_RE = re.compile(r"Peak FLOPS used for computing MFU: (?P<peak>\S+)")
_MODEL_RE = re.compile(r"Model (?P<name>\S+) (?P<flavor>\S+) size: (?P<params>[\d,]+) total parameters")
_START_RE = re.compile(r"Training starts at step (?P<step>\d+)")
# integrations/torchtitan/converter.py's line: which expert path and router the swapped layers run
_SWAP_RE = re.compile(
    r"\[mega_moe\] swapped (?P<layers>\d+) MoE layers to the fused op: precision=(?P<precision>[^,]+), "
    r"backend=(?P<backend>[^,]+), router (?P<router>[^,]+),"
)


def strip_ansi(line: str) -> str:
    return _ANSI_RE.sub("", line)


def _num(text: str) -> float:
    """A number as TorchTitan prints it: thousands separators allowed, `nan`/`inf` kept."""
    return float(text.replace(",", ""))


def parse_timestamp(line: str) -> dt.datetime | None:
    m = _TIME_RE.search(line)
    if m is None:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(microsecond=int(m.group(2)) * 1000)


@dataclasses.dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    memory_gib: float  # peak reserved since the previous log line
    memory_pct: float
    tps: float  # tokens/s per device, as TorchTitan reports it (rounded to an integer)
    tflops: float
    mfu_pct: float
    time: dt.datetime | None = None  # the log line's timestamp (ms resolution)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["time"] = self.time.isoformat(timespec="milliseconds") if self.time else None
        return d


def parse_step_line(line: str) -> StepMetrics | None:
    """The metrics of one training-step log line, or None for any other line."""
    line = strip_ansi(line)
    m = _STEP_RE.search(line)
    if m is None:
        return None
    g = m.groupdict()
    return StepMetrics(
        step=int(g["step"]),
        loss=_num(g["loss"]),
        grad_norm=_num(g["grad_norm"]),
        memory_gib=_num(g["memory_gib"]),
        memory_pct=_num(g["memory_pct"]),
        tps=_num(g["tps"]),
        tflops=_num(g["tflops"]),
        mfu_pct=_num(g["mfu_pct"]),
        time=parse_timestamp(line),
    )


@dataclasses.dataclass
class LogParser:
    """Feed a training log line by line; collects step metrics and run facts.

    A repeated step number (several ranks printing into one stream) keeps the first occurrence.
    """

    steps: list[StepMetrics] = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)
    start_time: dt.datetime | None = None  # "Training starts at step N": the start of step 1's interval

    def feed(self, raw_line: str) -> StepMetrics | None:
        line = strip_ansi(raw_line)
        step = parse_step_line(line)
        if step is not None:
            if any(s.step == step.step for s in self.steps[-4:]):
                return None
            self.steps.append(step)
            return step
        if (m := _TRAINER_RE.search(line)) is not None:
            self.info.update({k: int(v) for k, v in m.groupdict().items()})
        elif (m := _DEVICE_RE.search(line)) is not None and "device_name" not in self.info:
            self.info["device_type"] = m.group("device_type").lower()
            self.info["device_name"] = m.group("device_name").strip()
            self.info["device_memory_gib"] = float(m.group("gib"))
        elif (m := _PEAK_RE.search(line)) is not None:
            self.info["peak_flops"] = _num(m.group("peak"))
        elif (m := _MODEL_RE.search(line)) is not None:
            self.info.update(model_name=m.group("name"), model_flavor=m.group("flavor"), model_params=int(_num(m.group("params"))))
        elif (m := _SWAP_RE.search(line)) is not None and "mega_moe_swap" not in self.info:
            g = m.groupdict()
            self.info["mega_moe_swap"] = {**g, "layers": int(g["layers"]), "router": g["router"].strip()}
        elif (m := _START_RE.search(line)) is not None and self.start_time is None:
            self.start_time = parse_timestamp(line)
        return None

    @property
    def tokens_per_step(self) -> int | None:
        """Tokens one rank processes per optimizer step, from the trainer's own log line."""
        i = self.info
        if "local_batch_size" not in i:
            return None
        return i["local_batch_size"] * i["seq_len"] * i["grad_accum_steps"]


def parse_log(text: str) -> LogParser:
    parser = LogParser()
    for line in text.splitlines():
        parser.feed(line)
    return parser
