"""Test-session setup.

Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before triton is
first imported (some test modules import TorchTitan, which imports triton): so it is set here, once,
for the whole session. With a GPU the kernels are compiled and run on it as usual.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
