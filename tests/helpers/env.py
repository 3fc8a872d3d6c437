"""The test process and its children: the repo root, the venv's interpreter, thread counts."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from pipeline.paths import REPO_ROOT

REPO = REPO_ROOT  # the one repo root (tests never compute it from their own path)
PYTHON = REPO / ".venv" / "bin" / "python"


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch threads, then restore the previous count.

    The tests decode a tiny model: each op is so small that a second thread only adds
    synchronisation, and on a busy shared machine (where the other thread's core is taken) that
    makes decoding 10-40x slower. `runtime.model.load_model` sets all cores once per process,
    so the tests set this around each test rather than once."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pin_to_one_cpu() -> None:
    """`preexec_fn` for child interpreters: one CPU, so the runtime (which uses every CPU it may
    run on) decodes the tiny model single-threaded, for the reason given in `torch_threads`."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def python_exe() -> str:
    """The venv's interpreter (falls back to the running one, e.g. in another checkout layout)."""
    import sys

    return str(PYTHON) if PYTHON.is_file() else sys.executable


def subprocess_env() -> dict[str, str]:
    """Environment for child interpreters: the repo importable, few threads (the CPU is shared)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env
