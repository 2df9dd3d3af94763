"""Test-session setup.

Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before triton is
first imported (some test modules import TorchTitan, which imports triton): so it is set here, once,
for the whole session. With a GPU the kernels are compiled and run on it as usual.
"""

import os

# CPU threads per pytest-xdist worker: the cores shared out among the workers, for the worker itself and
# for the processes it starts (TorchTitan runs, EP ranks, child interpreters). Set before torch (and
# numpy's BLAS) load. CI runs 2 workers on 2 cores: with torch's default of a thread per core each OpenMP
# region spun on a core the other worker needed (a 1-rank training run took 21 s of CPU beside another,
# 9 s with 1 thread, the same losses to the last digit). A run without xdist keeps the defaults; an
# OMP_NUM_THREADS already set wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The suite's slowest files, heaviest first (serial seconds on a 2-core CI-like CPU, 2026-12-05: ~250,
# ~200, ~185, ~170, ~130, ~90, ~80, ~75, ~75, ~65 of ~1550). CI runs `-n 2 --dist loadfile`: each worker
# takes the next whole file when it is free, so starting with the longest keeps both busy to the end.
# xdist's own order (by test count) left the training runs for last, one worker finishing alone.
_SLOWEST_FILES = ("test_torchtitan_train.py", "test_fp8_kernels.py", "test_torchtitan_train_ep.py", "test_ep.py",
                  "test_ab_cli.py", "test_bench_scripts.py", "test_kernels_interpreter.py", "test_routing.py",
                  "test_tune.py", "test_fp8_training_compare.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist present: keep the order made below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole, the rest in order
