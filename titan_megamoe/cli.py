"""`titan-megamoe` command line: `train` (TorchTitan with our extension), `ab` (stock vs mega_moe) and
`tune` (tile configs for a shape, measured on this GPU)."""

from __future__ import annotations

import sys

USAGE = """usage: titan-megamoe {train,ab,tune} ... | --version

  train --config X.toml [torchtitan overrides ...]   run the TorchTitan 0.2.2 trainer with titan-megamoe loaded
  ab [--config X.toml] [--steps N] [--warmup W] [--out DIR] [--arms A,B] [--stock-args "..."] [--mega-args "..."]
     [--repeat-args "..."] [-- overrides]
                                                     run stock and mega_moe on the same config and compare
  tune --shape D H E K T [--precision bf16,fp8] [--budget-seconds S] [--out FILE]
                                                     tile configs for your shape, checked and timed on this GPU
  --version                                          versions of titan-megamoe, torch, triton, torchtitan, torchao
"""


def version_line() -> str:
    """Our version and the versions it runs against (a bug report needs all of them)."""
    import importlib.metadata

    from . import __version__

    deps = []
    for name in ("torch", "triton", "torchtitan", "torchao"):
        try:
            deps.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            deps.append(f"{name} not installed")
    return f"titan-megamoe {__version__} ({', '.join(deps)})"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(version_line())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .integrations.launch import main as train_main

        return train_main(rest)
    if command == "ab":
        from .ab.cli import main as ab_main

        return ab_main(rest)
    if command == "tune":
        from .tune.cli import main as tune_main

        return tune_main(rest)
    import difflib

    close = difflib.get_close_matches(command, ("train", "ab", "tune"), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"titan-megamoe: unknown command {command!r}{hint}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
