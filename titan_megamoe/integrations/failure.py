"""The one line that says why a TorchTitan job failed, found in its log.

A failing rank prints its traceback, torchrun then prints `ChildFailedError` with the same traceback again,
so the cause sits in the middle of ~130 lines. `titan-megamoe train` and `ab` keep the whole log in a file
and end the screen with this line instead. Our own errors (`[mega_moe] ...`) already name the fix.
"""

from __future__ import annotations

import re

_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_EXCEPTION = re.compile(r"^\s*(?P<kind>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)):\s*(?P<msg>\S.*)$")
_TORCHRUN_OWN = ("ChildFailedError",)  # torchrun's wrapper around the rank's error, not the cause
_BOX_LINE = re.compile(r"^│ ?(?P<text>.*?)\s*│$")  # tyro's boxed CLI errors


def _tyro_box(lines: list[str]) -> str | None:
    """`Unrecognized options: --training.stpes, 3; perhaps you meant --training.steps INT` from tyro's box."""
    for i, line in enumerate(lines):
        if not line.startswith("╭─"):
            continue
        body = []
        for inner in lines[i + 1:]:
            m = _BOX_LINE.match(inner)
            if m is None:
                break
            body.append(m.group("text").strip())
        first = []
        for text in body:
            if text.startswith("──"):
                break
            first.append(text)
        if not first:
            continue
        msg = " ".join(first)
        if "Perhaps you meant:" in body:
            k = body.index("Perhaps you meant:")
            if k + 1 < len(body):
                msg += f"; perhaps you meant {body[k + 1]}"
        return msg
    return None


def first_error(log_text: str) -> str | None:
    """The first exception a rank raised (its message alone when it is ours), else tyro's CLI error."""
    lines = [_RANK_PREFIX.sub("", line.rstrip("\n")) for line in log_text.splitlines()]
    for line in lines:
        m = _EXCEPTION.match(line)
        if m is None or m.group("kind").rsplit(".", 1)[-1] in _TORCHRUN_OWN:
            continue
        msg = m.group("msg").strip()
        return msg if msg.startswith("[mega_moe]") else f"{m.group('kind').rsplit('.', 1)[-1]}: {msg}"
    return _tyro_box(lines)
