"""Issue 7: nothing a user points EntMTP at may run foreign code or be silently wrong.

* a source scan: runtime/ and pipeline/ never unpickle, never `torch.load` without
  weights_only=True, never `np.load` with allow_pickle, never eval/exec, never trust remote code
  (the scanner is tested on crafted snippets first, so it can fail);
* a pickle payload put where a bank's tensors belong is refused without being executed;
* fuzzing (slow): random damage to bank.json and buffers.safetensors never lets anything but
  BankError out of `TopologyBank.load`, and whatever it accepts is internally consistent.
"""

from __future__ import annotations

import ast
import json
import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest

from pipeline.paths import REPO_ROOT
from runtime.bank import BANK_JSON, BUFFERS, BankError, TopologyBank
from tests.helpers import HEADS_FP, MODEL_FP, make_bank, reseal

ROOT = REPO_ROOT
SCANNED = ("runtime", "pipeline")

# ------------------------------------------------------------------------------- source scan

# Modules whose only purpose is (un)pickling: importing them at all is refused...
UNPICKLING_MODULES = {"dill", "cloudpickle", "shelve", "marshal", "_pickle", "cPickle"}
# ...except the standard `pickle`, whose exception classes a safe loader may catch (torch.load with
# weights_only=True raises pickle.UnpicklingError on a payload); every other use is refused.
PICKLE_SAFE_ATTRS = {"UnpicklingError", "PicklingError", "PickleError"}
ALWAYS_BANNED_CALLS = {
    "torch.jit.load": "TorchScript archives carry code",
    "pandas.read_pickle": "unpickles",
    "joblib.load": "unpickles",
    "joblib.dump": "writes a pickle",
    "yaml.unsafe_load": "constructs arbitrary Python objects",
    "eval": "executes text as code",
    "exec": "executes text as code",
}


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> fully qualified name, from the module's import statements."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, imports: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(imports.get(node.id, node.id))
    name = ".".join(reversed(parts))
    return name.replace("np.", "numpy.", 1) if name.startswith("np.") else name


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def scan_source(source: str, filename: str = "<snippet>") -> list[str]:
    """Every construct in `source` that could execute code from an artifact, as 'file:line: why'."""
    tree = ast.parse(source, filename)
    imports = _imports(tree)
    found = []

    def flag(node: ast.AST, why: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {why}")

    # `pickle.UnpicklingError` and the like: the one allowed use of the pickle module.
    safe_pickle_refs = {
        id(node.value) for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in PICKLE_SAFE_ATTRS
        and isinstance(node.value, ast.Name) and imports.get(node.value.id) == "pickle"
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in UNPICKLING_MODULES:
                    flag(node, f"imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UNPICKLING_MODULES | {"pickle"}:
            for a in node.names:
                if node.module != "pickle" or a.name not in PICKLE_SAFE_ATTRS:
                    flag(node, f"imports {a.name} from {node.module}")
        elif isinstance(node, ast.Name) and imports.get(node.id) == "pickle":
            if id(node) not in safe_pickle_refs:
                flag(node, f"uses the pickle module ({node.id})")
        elif isinstance(node, (ast.Name, ast.Attribute)):
            ident = node.id if isinstance(node, ast.Name) else node.attr
            if "pickle" in ident.lower() and ident not in PICKLE_SAFE_ATTRS:
                flag(node, f"uses {ident}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func, imports)
            shadowed = isinstance(node.func, ast.Name) and node.func.id in imports
            if name in ALWAYS_BANNED_CALLS and not shadowed:
                flag(node, f"calls {name}: {ALWAYS_BANNED_CALLS[name]}")
            if name == "torch.load" and not _is_const(_kw(node, "weights_only"), True):
                flag(node, "calls torch.load without weights_only=True (unpickles)")
            if name == "numpy.load" and _kw(node, "allow_pickle") is not None and not _is_const(_kw(node, "allow_pickle"), False):
                flag(node, "calls numpy.load with allow_pickle (unpickles)")
            if name == "yaml.load":
                loader = _kw(node, "Loader")
                loader_name = _dotted(loader, imports) if loader is not None else None
                if not (loader_name and loader_name.split(".")[-1] in ("SafeLoader", "CSafeLoader")):
                    flag(node, "calls yaml.load without a SafeLoader")
            for k in node.keywords:
                if k.arg and "pickle" in k.arg and not (k.arg == "allow_pickle" and _is_const(k.value, False)):
                    flag(node, f"passes {k.arg}=")
                if k.arg == "trust_remote_code" and not _is_const(k.value, False):
                    flag(node, "passes trust_remote_code (runs the checkpoint's own Python)")
    return found


@pytest.mark.parametrize("snippet", [
    "import pickle\npickle.loads(b'')",
    "import pickle as p\np.Unpickler(f).load()",
    "import pickle\ntorch.save(obj, f, pickle_module=pickle)",
    "from pickle import loads",
    "import _pickle",
    "import dill",
    "import torch\ntorch.load('x.pt')",
    "import torch\ntorch.load('x.pt', weights_only=False)",
    "import torch as T\nT.load('x.pt', map_location='cpu')",
    "from torch import load\nload('x.pt')",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
    "import numpy\nnumpy.load('x.npy', allow_pickle=flag)",
    "eval('1 + 1')",
    "exec(text)",
    "import pandas as pd\npd.read_pickle('x.pkl')",
    "df.to_pickle('x.pkl')",
    "import joblib\njoblib.load('x.joblib')",
    "import yaml\nyaml.load(text)",
    "import torch\ntorch.jit.load('m.pt')",
    "AutoModel.from_pretrained(path, trust_remote_code=True)",
    "torch.save(obj, f, pickle_module=m)",
])
def test_scanner_flags_each_unsafe_construct(snippet: str) -> None:
    assert scan_source(snippet), f"the scanner missed: {snippet!r}"


@pytest.mark.parametrize("snippet", [
    '"""Weights are safetensors: no pickle anywhere."""',
    "# we never pickle",
    "model.eval()",
    "import pickle\ntry:\n    pass\nexcept pickle.UnpicklingError:\n    pass",
    "from pickle import UnpicklingError",
    "import ast\nast.literal_eval('[1]')",
    "import torch\ntorch.load('x.pt', weights_only=True)",
    "import numpy as np\nnp.load('x.npy')\nnp.load('y.npy', allow_pickle=False)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "from safetensors.torch import load_file\nload_file('x.safetensors')",
    "AutoModel.from_pretrained(path, trust_remote_code=False)",
])
def test_scanner_allows_safe_constructs(snippet: str) -> None:
    assert scan_source(snippet) == []


def test_runtime_and_pipeline_never_execute_artifact_code() -> None:
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) >= 5, f"expected the runtime and pipeline sources under {ROOT}"
    found = [hit for p in files for hit in scan_source(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert not found, "constructs that can execute code from an artifact:\n" + "\n".join(found)


# ------------------------------------------------------------------------------- crafted payload


class _Payload:
    """Unpickling this creates a file: proof that a loader executed the artifact."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def test_pickle_payload_in_place_of_the_tensors_is_not_executed(tmp_path: Path) -> None:
    folder = tmp_path / "bank"
    make_bank().save(folder)
    marker = tmp_path / "pwned"
    (folder / BUFFERS).write_bytes(pickle.dumps({"tree0.depths": _Payload(marker)}))
    reseal(folder)  # an attacker can recompute the seal; the format itself must refuse the payload
    with pytest.raises(BankError, match="cannot be parsed"):
        TopologyBank.load(folder)
    assert not marker.exists(), "loading the bank executed the pickle payload"
    (folder / BANK_JSON).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(BankError, match="not valid JSON"):
        TopologyBank.load(folder)
    assert not marker.exists()


# ------------------------------------------------------------------------------- fuzzing


def _good_files() -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as d:
        make_bank().save(d)
        return {name: (Path(d) / name).read_bytes() for name in (BANK_JSON, BUFFERS)}


def _load_checked(folder: Path, kwargs: dict[str, Any]) -> None:
    """Load; BankError is fine. Anything else escaping, or an inconsistent accepted bank, fails."""
    from runtime.policy import Scheduler

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bank = TopologyBank.load(folder, **kwargs)
    except BankError:
        return
    n = len(bank.trees)
    assert n == len(bank.buffers) == len(bank.figures) and n > 0
    assert 0 <= bank.best_static < n
    for k, (tree, buffers) in enumerate(zip(bank.trees, bank.buffers)):
        buffers.validate()
        assert buffers.to_tree() == tree
        assert k == 0 or tree.num_nodes >= bank.trees[k - 1].num_nodes
        if kwargs.get("max_depth") is not None:
            assert tree.depth <= kwargs["max_depth"]
    for d in bank.policies.values():
        Scheduler.from_dict(d, n_trees=n)
    if not kwargs.get("force"):
        for what, fp in (("model", kwargs.get("model_fingerprint")), ("heads", kwargs.get("heads_fingerprint"))):
            assert fp is None or bank.provenance.get(f"{what}_fingerprint") == fp


def _write(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).write_bytes(data)


@pytest.fixture(scope="module")
def good_files() -> dict[str, bytes]:
    return _good_files()


def test_undamaged_files_load_in_the_fuzz_harness(good_files: dict[str, bytes], tmp_path: Path) -> None:
    _write(tmp_path, good_files)
    TopologyBank.load(tmp_path, model_fingerprint=MODEL_FP, heads_fingerprint=HEADS_FP, max_depth=4)


def _strategies():
    from hypothesis import strategies as st

    # Small ints are what ranks, indices and depths look like: they get past type checks and
    # reach the consistency checks behind them.
    scalars = (st.integers(-2, 70) | st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
               | st.text(max_size=8))
    json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                               | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
    load_kwargs = st.fixed_dictionaries({
        "model_fingerprint": st.sampled_from([None, MODEL_FP, "other"]),
        "heads_fingerprint": st.sampled_from([None, HEADS_FP]),
        "max_depth": st.sampled_from([None, 0, 2, 4, 5]),
        "force": st.booleans(),
    })
    return st, json_values, load_kwargs


def _damage_doc(data, st, json_values, doc: Any, top: bool = True) -> Any:
    """Replace, delete or insert a value at a random place inside the JSON document.

    Half of the time the damage goes into the trees or the policies (the fields decoding relies
    on), and it tends to go deep (down to one rank of one path).
    """
    if top and isinstance(doc, dict) and data.draw(st.booleans()):
        key = data.draw(st.sampled_from([k for k in ("trees", "policies") if k in doc] or list(doc) or [None]))
        if key is not None:
            doc[key] = _damage_doc(data, st, json_values, doc[key], top=False)
            return doc
    if not isinstance(doc, (dict, list)) or not doc or data.draw(st.integers(0, 5)) == 0:
        return data.draw(json_values)
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = data.draw(st.sampled_from(keys))
    action = data.draw(st.sampled_from(["descend", "descend", "delete", "insert"]))
    if action == "delete":
        del doc[key]
    elif action == "insert":
        if isinstance(doc, dict):
            doc[data.draw(st.text(max_size=6))] = data.draw(json_values)
        else:
            doc.insert(key, data.draw(json_values))
    else:
        doc[key] = _damage_doc(data, st, json_values, doc[key], top=False)
    return doc


@pytest.mark.slow
def test_fuzz_bank_json_damage(good_files: dict[str, bytes]) -> None:
    from hypothesis import HealthCheck, given, settings

    st, json_values, load_kwargs = _strategies()

    @settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data(), kwargs=load_kwargs, sealed=st.booleans())
    def run(data, kwargs: dict[str, Any], sealed: bool) -> None:
        doc = _damage_doc(data, st, json_values, json.loads(good_files[BANK_JSON]))
        with tempfile.TemporaryDirectory() as d:
            folder = Path(d)
            _write(folder, {BANK_JSON: json.dumps(doc).encode(), BUFFERS: good_files[BUFFERS]})
            if sealed and isinstance(doc, dict):
                reseal(folder)  # exercise the content checks behind the checksum
            _load_checked(folder, kwargs)

    run()


@pytest.mark.slow
def test_fuzz_buffers_damage(good_files: dict[str, bytes]) -> None:
    from hypothesis import HealthCheck, given, settings

    st, _, load_kwargs = _strategies()
    size = len(good_files[BUFFERS])

    @settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        how=st.sampled_from(["flip", "flip", "flip", "cut", "append"]),
        cut=st.integers(0, size - 1),
        flips=st.lists(st.tuples(st.integers(0, size - 1), st.integers(1, 255)), min_size=1, max_size=8),
        tail=st.binary(min_size=1, max_size=16),
        sealed=st.booleans(),
        kwargs=load_kwargs,
    )
    def run(how: str, cut: int, flips, tail: bytes, sealed: bool, kwargs: dict[str, Any]) -> None:
        blob = bytearray(good_files[BUFFERS])
        if how == "flip":  # mostly lands in tensor data: parses, so the tree checks must catch it
            for pos, mask in flips:
                blob[pos] ^= mask
        blob = bytes(blob[:cut] if how == "cut" else blob) + (tail if how == "append" else b"")
        with tempfile.TemporaryDirectory() as d:
            folder = Path(d)
            _write(folder, {BANK_JSON: good_files[BANK_JSON], BUFFERS: blob})
            if sealed:
                reseal(folder)  # a writer that sealed damaged tensors: the parser and tree checks must hold
            _load_checked(folder, kwargs)

    run()


@pytest.mark.slow
def test_fuzz_raw_bank_json_bytes(good_files: dict[str, bytes]) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
    def run(raw: bytes) -> None:
        with tempfile.TemporaryDirectory() as d:
            _write(Path(d), {BANK_JSON: raw, BUFFERS: good_files[BUFFERS]})
            _load_checked(Path(d), {})

    run()
