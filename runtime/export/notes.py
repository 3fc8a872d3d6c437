"""What an export says about itself: which bank, drafter and machine its numbers come from, what the
target engine (and which of its versions) does with them, and where that differs from what was
measured.

An `ExportRecord` holds a header (engine and versions, drafter kind, where and in which dtype the
bank was measured), the engine's caveats and the warnings for this bank. `entmtp export` prints it
on stderr and records it where the engine tolerates it (`embed_record`): SGLang's flag lines take
``# [entmtp]`` comment lines and its adaptive config an ``"_entmtp"`` key (``_load_adaptive_config``
in python/sglang/srt/speculative/adaptive_spec_params.py skips non-digit keys, and a slot reads only
the settings it knows); our json format takes a ``"notes"`` object. vLLM's ``SpeculativeConfig``
(``extra="forbid"``, vllm/config/utils.py ``config``), TensorRT-LLM's ``DecodingBaseConfig``
(``StrictBaseModel``) and the tree formats (a bare string or list) take nothing: their record goes
to a sidecar file beside the export (`SIDECAR_SUFFIX`, written by ``entmtp export --out``).

The caveats come from the engines' code and issues (cited in each); versions are named by the PR
that introduced or removed a feature where no release is known here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.export.engines import DRAFTER_PLACEHOLDER, ENGINE_FORMATS, TREE_FORMATS, fill_vllm_zeros
from runtime.export.schedule import ServingSchedule

SIDECAR_SUFFIX = ".entmtp.json"
RECORD_FORMAT = "entmtp-export-record"
COMMENT = "# [entmtp] "
DRAFTER_KINDS = ("eagle3", "hydra", "medusa", "unknown")

ENGINE_NAMES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "sglang": "SGLang", "json": "your own scheduler",
                "legacy-vllm-tree": "vLLM (legacy tree)", "legacy-trtllm-medusa": "TensorRT-LLM (legacy Medusa)",
                "tree-json": "Medusa/Hydra research code"}
# which versions of the engine read the format
VERSIONS = {
    "vllm": "vLLM with num_speculative_tokens_per_batch_size (PR #32374 'Dynamic SD'), V1 model runner",
    "trtllm": "TensorRT-LLM with draft_len_schedule on the one-model path (PR #10860), PyTorch backend",
    "sglang": "SGLang with --speculative-adaptive (PR #21599) and per-batch-size slots (PR #24055); flags and "
              "adaptive config checked with sglang 0.5.23's own code",
    "json": "EntMTP's serving schedule, version 1 (no engine reads it)",
    "legacy-vllm-tree": "vLLM releases whose EAGLE tree drafter read speculative_token_tree, up to the one before "
                        "PR #42121 removed tree attention; later releases refuse the key",
    "legacy-trtllm-medusa": "TensorRT-LLM's TensorRT-engine backend (Medusa never ran on its PyTorch backend: "
                            "MedusaDecodingConfig.supports_backend), up to the release before PR #15918 removed "
                            "that legacy backend",
    "tree-json": "no serving engine: Medusa/Hydra choices files and runtime.tree.Tree.parse",
}
# the drafters whose measured schedule transfers to the engine as it is
RUNS = {"vllm": ("eagle3",), "sglang": ("eagle3",), "trtllm": ("eagle3",), "legacy-vllm-tree": ("eagle3",),
        "legacy-trtllm-medusa": ("medusa",), "json": DRAFTER_KINDS, "tree-json": DRAFTER_KINDS}
_WHY_NOT = {
    "vllm": "vLLM loads no Medusa/Hydra heads of this kind (its speculators format has types eagle3, mtp, dflash, "
            "...; the Hydra proposal vllm-project/speculators#740 was closed) and documents per-batch-size lengths "
            "as tested with EAGLE, EAGLE-3 and DFlash",
    "sglang": "SGLang serves EAGLE/EAGLE3, MTP, n-gram and draft-model drafters, no Medusa/Hydra heads, and its "
              "adaptive mode needs EAGLE/EAGLE3",
    "trtllm": "TensorRT-LLM honours draft_len_schedule only in its one-model EAGLE3 / MTP / MTP-Eagle, PARD, DFlash, "
              "draft-target and SA modes; its Medusa runs only on the legacy TensorRT backend",
    "legacy-vllm-tree": "vLLM's tree drafting ran EAGLE drafters",
    "legacy-trtllm-medusa": "TensorRT-LLM's Medusa decoding runs Medusa heads",
}


# ---------------------------------------------------------------------------------- the bank


@dataclass(frozen=True)
class BankFacts:
    """Where a bank's figures come from: `drafter` (one of `DRAFTER_KINDS`), the heads' name, the
    device kind it was timed on ("cpu", "cuda", ... or "unknown"), the CPU or GPU model, cores,
    dtype, kernel and torch version, and the bank folder (`source`)."""

    source: str | None = None
    drafter: str = "unknown"
    heads_name: str | None = None
    device: str = "unknown"
    hardware: str | None = None
    cores: int | None = None
    dtype: str | None = None
    kernel: str | None = None
    torch: str | None = None

    @property
    def on_cpu(self) -> bool:
        return self.device.startswith("cpu")

    def measured_on(self) -> str:
        kind = "CPU" if self.on_cpu else "GPU" if self.device.startswith(("cuda", "rocm", "xpu")) else "device"
        bits = [f"{kind} {self.hardware or '(unrecorded)'}" + (f" ({self.cores} cores)" if self.cores and self.on_cpu
                                                               else "")]
        bits.append(f"dtype {self.dtype or 'unrecorded'}")
        if self.kernel and self.on_cpu:
            bits.append(f"kernel {self.kernel}")
        if self.torch:
            bits.append(f"torch {self.torch}")
        return ", ".join(bits)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "drafter": self.drafter, "heads_name": self.heads_name, "device": self.device,
                "hardware": self.hardware, "cores": self.cores, "dtype": self.dtype, "kernel": self.kernel,
                "torch": self.torch}


def _config_of(provenance: Mapping[str, Any]) -> Mapping[str, Any]:
    cfg = provenance.get("config")
    return cfg if isinstance(cfg, Mapping) else {}


def drafter_kind(heads_dir: str | Path | None, provenance: Mapping[str, Any]) -> str:
    """The bank's drafter: what its heads folder's config.json says (an EAGLE-3 drafter's format tag,
    or the heads' ``kind``), else the bank's recorded heads config or heads name; "unknown" otherwise."""
    from runtime.eagle3 import FORMAT as DRAFTER_FORMAT

    raw: Any = None
    if heads_dir is not None:
        try:
            raw = json.loads((Path(heads_dir) / "config.json").read_text())
        except (OSError, ValueError):
            raw = None
    if isinstance(raw, Mapping):
        if raw.get("format") == DRAFTER_FORMAT:
            return "eagle3"
        if raw.get("kind") in DRAFTER_KINDS:
            return raw["kind"]
    heads = _config_of(provenance).get("heads")
    if isinstance(heads, Mapping) and heads.get("kind") in DRAFTER_KINDS:
        return heads["kind"]
    name = str(provenance.get("heads_name") or "")
    return next((k for k in ("eagle3", "hydra", "medusa") if name.startswith(k)), "unknown")


def bank_facts(provenance: Mapping[str, Any], drafter: str = "unknown", source: str | None = None) -> BankFacts:
    """`BankFacts` from a bank's provenance (bank.json): its device (recorded, else the pipeline
    config's, else "cpu" when the machine had no GPU), CPU or GPU model, dtype, kernel, torch."""
    machine = provenance.get("machine") if isinstance(provenance.get("machine"), Mapping) else {}
    device = str(provenance.get("device") or _config_of(provenance).get("device") or "")
    if not device or device == "auto":
        device = "cpu" if not machine.get("cuda") else "unknown"
    gpu = not device.startswith("cpu") and device != "unknown"
    hardware = machine.get("cuda") if gpu else machine.get("cpu")
    return BankFacts(source=source, drafter=drafter if drafter in DRAFTER_KINDS else "unknown",
                     heads_name=provenance.get("heads_name"), device=device,
                     hardware=None if hardware is None else str(hardware),
                     cores=machine.get("cores") if isinstance(machine.get("cores"), int) else None,
                     dtype=provenance.get("dtype"), kernel=provenance.get("kernel"), torch=machine.get("torch"))


# -------------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class ExportRecord:
    """What an export says about itself (see the module docstring)."""

    fmt: str
    header: str
    caveats: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    facts: BankFacts = field(default_factory=BankFacts)
    margin: int = 0
    filled_zeros: tuple[tuple[int, int], ...] = ()  # vLLM: (batch size, chain length written instead of 0)
    drafter_path: str | None = None

    def lines(self) -> list[str]:
        """The record as text lines (stderr, comments)."""
        return ([self.header] + [f"caveat: {c}" for c in self.caveats] + [f"WARNING: {w}" for w in self.warnings])

    def to_dict(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, "export_format": self.fmt, "header": self.header,
                "caveats": list(self.caveats), "warnings": list(self.warnings), "bank": self.facts.to_dict(),
                "margin": self.margin, "filled_zeros": {str(b): k for b, k in self.filled_zeros},
                "drafter_path": self.drafter_path}


def _ranges_at_zero(schedule: ServingSchedule) -> str:
    """The load ranges a served schedule drafts 0 in (inside its batch sizes, then above the largest)."""
    spans: list[list[int | None]] = []  # [first, last] load of each run of zeros (last None: no end)
    lo = 1
    for c in schedule.choices:
        if c.chain_len == 0:
            if spans and spans[-1][1] == lo - 1:
                spans[-1][1] = c.batch_size
            else:
                spans.append([lo, c.batch_size])
        lo = c.batch_size + 1
    if schedule.choices[-1].chain_len > 0:
        spans.append([lo, None])
    elif spans:
        spans[-1][1] = None  # vLLM keeps the last range's 0 up to max_num_seqs
    return ", ".join(f"{a} and above" if b is None else f"{a}-{b}" if a < b else f"{a}" for a, b in spans)


def _vllm_caveats(schedule: ServingSchedule, margin: int, keep_zeros: bool,
                  filled: dict[int, tuple[int, float, float]]) -> list[str]:
    served = (schedule if keep_zeros else fill_vllm_zeros(schedule)[0]).shifted(margin)
    zero = (f"vLLM still runs the drafter at draft length 0, to keep its KV cache in sync (vllm-project/vllm#49548): "
            f"a 0 is plain AR plus drafting, slower than AR; this export drafts 0 at loads {_ranges_at_zero(served)}")
    if filled:
        zero += "; " + "; ".join(f"at batch size {b} the bank's chain of length {d} measured {tps:.1f} tok/s against "
                                 f"AR's {ar:.1f}, so {d} is written instead of 0" for b, (d, tps, ar) in filled.items())
        zero += " (--keep-zeros writes the bank's 0s)"
    elif not keep_zeros:
        zero += " (the bank measured no chain at AR's speed or better there, so no 0 could be replaced)"
    return [
        zero,
        "vLLM's V2 model runner ignores num_speculative_tokens_per_batch_size (vllm-project/vllm#51510): serve with "
        "VLLM_USE_V2_MODEL_RUNNER=0",
        "under data parallelism (data_parallel_size > 1) vLLM keeps only a constant per-batch-size schedule; a varying "
        "one is turned off (its scheduler logs that dynamic speculative decoding is not supported)",
        "vLLM's batch size counts every scheduled request, prefills included, and a schedule that flips at one batch "
        f"size collapses throughput when the load hovers there (vllm-project/vllm#49548): --margin N keeps each choice "
        f"for N more sequences (this export: margin {margin})",
        "vLLM refuses unknown keys in speculative_config (SpeculativeConfig forbids extra fields), so this record is "
        "not inside the config: `entmtp export --out FILE` writes it beside it",
    ]


def _trtllm_caveats(eagle3: bool, margin: int) -> list[str]:
    out = [
        "TensorRT-LLM's one-model EAGLE3 / MTP / MTP-Eagle modes read draft_len_schedule as 'the first key >= the batch "
        "size; 0 above the last key' (get_draft_len_for_batch_size, tensorrt_llm/_torch/speculative/utils.py, PR "
        "#10860), which is what this export writes; its Drafter paths (n-gram, user drafters, PR #8194) read 'the "
        "largest key <= the batch size', which moves every choice to the next measured batch size; vanilla "
        "multi-module MTP ignores the schedule",
        "TensorRT-LLM looks the length up by the batch size it schedules, which can hold requests the bank's timed "
        f"decode batches did not: --margin N keeps each choice for N more sequences (this export: margin {margin})",
        "TensorRT-LLM's speculative config refuses unknown keys (DecodingBaseConfig is a StrictBaseModel), so this "
        "record is not inside the config: `entmtp export --out FILE` writes it beside it",
    ]
    if eagle3:
        out.append("eagle3_one_model is true: the two-model Eagle3 path is deprecated (EagleDecodingConfig warns it "
                   "will be removed); eagle3_layers_to_capture names layer OUTPUTS (our ids minus one). The EAGLE-layout "
                   "folder and these fields were checked against TensorRT-LLM's source (llm_args.py, "
                   "modeling_speculative.py), not run: the package does not install on this CPU")
    return out


def _sglang_caveats(eagle3: bool, margin: int) -> list[str]:
    out = [
        "the static lines give SGLang budgets (steps, top-k, draft tokens); SGLang grows its own EAGLE tree within "
        "them, the bank's exact trees are not passed",
        "--speculative-adaptive runs only with EAGLE/EAGLE3, --speculative-eagle-topk 1, no attention DP, no "
        "multi-layer EAGLE and no two-batch overlap (adaptive_unsupported_reason, "
        "python/sglang/srt/speculative/adaptive_spec_params.py)",
        "the adaptive router pads the batch size up to a CUDA-graph batch size before its lookup: the schedule holds "
        "exactly when its batch sizes are among --cuda-graph-bs",
        f"boundary margin {margin}: the adaptive slots start at the measured batch sizes + margin + 1",
    ]
    if eagle3:
        out.append("SGLang loads an EAGLE-3 drafter as LlamaForCausalLMEagle3 (EAGLE's own layout, which --drafter-out "
                   "writes for --format sglang; it has no speculators reader) and adds one to the "
                   "eagle_aux_hidden_state_layer_ids of its config")
    return out


def export_record(schedule: ServingSchedule, fmt: str, facts: BankFacts, *, margin: int = 0,
                  keep_zeros: bool = False, drafter_path: str | None = None) -> ExportRecord:
    """The record of exporting `schedule` (already restricted to a batch size, if one was asked for)
    in `fmt` for a bank described by `facts`."""
    engine = ENGINE_NAMES.get(fmt, fmt)
    eagle3 = facts.drafter == "eagle3"
    header = (f"EntMTP export for {engine} of bank {facts.source or '(in memory)'}: drafter {facts.drafter}"
              + (f" ({facts.heads_name})" if facts.heads_name else "") + f", measured on {facts.measured_on()}")
    filled: dict[int, tuple[int, float, float]] = {}
    caveats: list[str] = [f"read by {VERSIONS[fmt]}"] if fmt in VERSIONS else []
    if fmt == "vllm":
        if not keep_zeros:
            filled = fill_vllm_zeros(schedule)[1]
        caveats += _vllm_caveats(schedule, margin, keep_zeros, filled)
    elif fmt == "trtllm":
        caveats += _trtllm_caveats(eagle3, margin)
    elif fmt == "sglang":
        caveats += _sglang_caveats(eagle3, margin)
    elif fmt in TREE_FORMATS:
        caveats.append("one tree for every load")
    warnings = []
    if facts.drafter not in RUNS.get(fmt, DRAFTER_KINDS):
        warnings.append(f"the bank was measured with {facts.drafter} heads, but {_WHY_NOT[fmt]}: {engine} applies these "
                        "numbers to the drafter it runs, whose acceptance and cost differ; rebuild the bank with "
                        "heads=eagle3 for numbers measured on a drafter the engine runs")
    if fmt in ENGINE_FORMATS or fmt in ("legacy-vllm-tree", "legacy-trtllm-medusa"):
        if facts.on_cpu:
            warnings.append(f"the bank was measured on a CPU ({facts.hardware or 'unrecorded'}); {engine} serves on "
                            "GPUs, where a step's cost grows differently with batch size and draft length, so the "
                            "switch points will move: rebuild the bank on the serving GPU before trusting them there")
        elif facts.device == "unknown":
            warnings.append("the bank does not record the device it was timed on: check it was the serving GPU")
        if eagle3 and fmt in ENGINE_FORMATS and drafter_path in (None, DRAFTER_PLACEHOLDER):
            warnings.append(f"the config names the drafter folder {DRAFTER_PLACEHOLDER}: pass --drafter-out DIR to "
                            f"write the bank's drafter in the layout {engine} loads, or --drafter-path to name one")
    return ExportRecord(fmt=fmt, header=header, caveats=tuple(caveats), warnings=tuple(warnings), facts=facts,
                        margin=margin, filled_zeros=tuple((b, v[0]) for b, v in sorted(filled.items())),
                        drafter_path=drafter_path)


# ----------------------------------------------------------------------------- recording it


def in_band(fmt: str) -> bool:
    """Whether the export itself can carry its record (SGLang's flag lines, our json)."""
    return fmt in ("sglang", "json")


def embed_record(out: str | dict[str, Any], fmt: str, record: ExportRecord) -> str | dict[str, Any]:
    """`out` with its record inside where the format tolerates one (see the module docstring):
    SGLang text gets ``# [entmtp]`` lines after its first line and an ``"_entmtp"`` key in its
    adaptive config; json a ``"notes"`` object; every other export is returned unchanged."""
    if fmt == "json" and isinstance(out, dict):
        return {**out, "notes": record.to_dict()}
    if fmt != "sglang" or not isinstance(out, str):
        return out
    lines = out.splitlines()
    comments = [COMMENT + ln for ln in record.lines()]
    tag = {"source": record.facts.source, "drafter": record.facts.drafter, "measured_on": record.facts.measured_on(),
           "margin": record.margin}
    for i, ln in enumerate(lines):
        if ln.startswith("{"):
            lines[i] = json.dumps({**json.loads(ln), "_entmtp": tag})
    return "\n".join(lines[:1] + comments + lines[1:]) + "\n"


def sidecar_path(out_path: str | Path) -> Path:
    """Where `entmtp export --out FILE` writes the record: FILE + `SIDECAR_SUFFIX`."""
    p = Path(out_path)
    return p.with_name(p.name + SIDECAR_SUFFIX)
