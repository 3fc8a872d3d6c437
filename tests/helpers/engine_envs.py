"""Interpreters that hold a serving engine's own package, for the tests that check an export with
that package's code (marked ``engines``; skipped where none is found).

The engines pin other versions of what this project needs (speculators 0.9.0 and sglang 0.5.23
want transformers <= 5.19, the pipeline >= 5.20), so they live in virtual environments of their own
beside the checkout, installed with ``--no-deps`` (what installed on a 2-core CPU box, torch 2.13 CPU):

    # SGLang: its package and the few it imports to parse flags; torch and transformers come from
    # this project's venv through a .pth file (nothing is installed into that venv)
    python3.11 -m venv ../venv-sglang
    echo "$PWD/.venv/lib/python3.11/site-packages" > ../venv-sglang/lib/python3.11/site-packages/project.pth
    ../venv-sglang/bin/pip install --no-deps sglang==0.5.23 orjson pybase64 triton starlette msgspec pyzmq \
        IPython traitlets
    ../venv-sglang/bin/pip install aiohttp
    # speculators: its own torch (the CPU wheel) and transformers 5.19
    python3.11 -m venv ../venv-spec
    ../venv-spec/bin/pip install torch==2.13.0+cpu "transformers<=5.19" safetensors loguru pydantic-settings \
        openai datasets
    ../venv-spec/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0

`engine_python` finds one: the interpreter named by ``ENTMTP_<PACKAGE>_PYTHON``, the running one if
it imports the package, else ``<checkout>/../venv-<name>/bin/python`` (`VENVS`). The check scripts
(tests/helpers/sglang_check.py, tests/helpers/speculators_check.py) run there by path and import
nothing of this project. vLLM and TensorRT-LLM do not install on a CPU: their fields are checked
against their source, cited in the tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.env import REPO

# package -> sibling venv folder names searched, in order
VENVS = {"sglang": ("venv-sglang",), "speculators": ("venv-speculators", "venv-spec")}
HELPERS = Path(__file__).resolve().parent


def _imports(python: str, package: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def engine_python(package: str) -> str | None:
    """An interpreter that imports `package` (see the module docstring), or None."""
    named = os.environ.get(f"ENTMTP_{package.upper()}_PYTHON")
    if named:
        return named if _imports(named, package) else None
    if importlib.util.find_spec(package) is not None:
        return sys.executable
    for name in VENVS.get(package, (f"venv-{package}",)):
        python = REPO.parent / name / "bin" / "python"
        if python.is_file() and _imports(str(python), package):
            return str(python)
    return None


def run_check(python: str, script: str, request: dict[str, Any], workdir: Path, timeout: int = 600) -> Any:
    """Run tests/helpers/`script` under `python` with `request` (JSON) and return its JSON answer; the
    script's stderr is shown when it fails."""
    req, ans = workdir / "request.json", workdir / "answer.json"
    req.write_text(json.dumps(request))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([python, str(HELPERS / script), str(req), str(ans)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=workdir)
    if proc.returncode != 0:
        raise AssertionError(f"{script} under {python} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(ans.read_text())
