"""`runtime` is what other programs embed: importing all of it must not pull in the pipeline or
its heavy dependencies (hydra-core, omegaconf, pandas, matplotlib, transformers, datasets).

Checked in a clean interpreter, since this test session itself imports all of those.
"""

from __future__ import annotations

import json
import subprocess

from tests.helpers import REPO, python_exe, subprocess_env

RUNTIME_MODULES = (
    "runtime", "runtime.api", "runtime.cli", "runtime.decoder", "runtime.bank", "runtime.policy", "runtime.heads",
    "runtime.model", "runtime.tree", "runtime.export.engines", "runtime.ar", "runtime.fingerprint",
)
FORBIDDEN = ("pipeline", "hydra", "omegaconf", "pandas", "matplotlib", "transformers", "datasets")

PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
if "runtime" in sys.modules:
    sys.modules["runtime"].EntMTP  # the lazy public names resolve too
roots = sorted({{m.split(".")[0] for m in sys.modules}})
print(json.dumps(roots))
"""


def imported_roots(modules: tuple[str, ...]) -> set[str]:
    """Top-level names in sys.modules of a fresh interpreter after importing `modules`."""
    code = PROBE.format(modules=modules)
    proc = subprocess.run([python_exe(), "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_probe_detects_a_forbidden_import() -> None:
    assert "omegaconf" in imported_roots(("json", "omegaconf"))


def test_runtime_imports_no_pipeline_dependencies() -> None:
    roots = imported_roots(RUNTIME_MODULES)
    assert "runtime" in roots and "torch" in roots  # the probe really imported the runtime
    leaked = sorted(roots & set(FORBIDDEN))
    assert not leaked, f"importing the runtime also imported {leaked}: runtime must stay slim"
