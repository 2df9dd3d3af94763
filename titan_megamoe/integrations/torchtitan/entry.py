"""One trainer process: `python -m titan_megamoe.integrations.torchtitan.entry [TorchTitan args ...]`.

`titan-megamoe train` starts this module under torchrun. On a host without CUDA it first applies the
CPU patches (cpu.py); then it runs TorchTitan 0.2.2's own `torchtitan.train.main(Trainer)`, so the
trainer, its arguments and its exit status are stock (on CPU a finished run exits without the
interpreter teardown: `cpu.exit_skipping_teardown`).
"""

from __future__ import annotations


def main() -> None:
    from . import cpu

    if cpu.needed():
        cpu.apply()

    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    torchtitan_main(Trainer)
    if cpu.needed():  # finished: its process group is destroyed; gloo's teardown could still abort the exit
        cpu.exit_skipping_teardown()


if __name__ == "__main__":
    main()
