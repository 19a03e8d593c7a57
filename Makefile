VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
#: What the demo needs, at requirements.txt's pins: the package (torch, Lightning,
#: torchmetrics, jsonargparse) and accelerate for its side-by-side row.
DEMO_PINS = $(shell grep -E '^(torch|lightning|torchmetrics|accelerate)==' requirements.txt)

.PHONY: install install-demo test test-torch test-slow lint demo bench gpu-check gpu-wheels clean

install: $(STAMP)

install-demo: $(DEMO_STAMP)

$(DEMO_STAMP): requirements.txt setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(DEMO_PINS) -e ".[accelerate]"
	touch $(DEMO_STAMP)

$(STAMP): requirements.txt requirements-deepspeed.txt setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e ".[test,bench,ray]"
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation -r requirements-deepspeed.txt
	@if $(PY) -c "import torchvision" 2>/dev/null; then echo "torchvision must not be installed"; exit 1; fi
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The suite on both cores of the CI machine: one file per worker at a time (so a file's
# module fixtures are built once), the longest files first (tests/conftest.py).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint
	$(VENV)/bin/pytest $(PYTEST_PARALLEL)

# The whole suite on another torch, in a venv of its own (.venv-torch-...), with the
# project installed with its dependencies beside it:
#   make test-torch TORCH=2.15.0 [LIGHTNING=2.6.0] [TRANSFORMERS=5.0.0]
TORCH ?= 2.15.0
TORCH_PINS := torch==$(TORCH) $(if $(LIGHTNING),lightning==$(LIGHTNING)) \
	$(if $(TRANSFORMERS),transformers==$(TRANSFORMERS))
TORCH_VENV := .venv-torch-$(TORCH)$(if $(LIGHTNING),-lightning-$(LIGHTNING))$(if \
	$(TRANSFORMERS),-transformers-$(TRANSFORMERS))

test-torch:
	bash .ci/venv $(TORCH_VENV) $(TORCH_PINS)
	$(TORCH_VENV)/bin/pytest $(PYTEST_PARALLEL)

test-slow: install
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) -m slow

# The demo installs only what it needs (make test adds the test extras to the same venv).
demo: $(if $(wildcard $(STAMP)),install,install-demo)
	$(PY) examples/demo.py

bench: install
	$(PY) benchmarks/compile_time.py
	$(PY) benchmarks/steady_step.py
	$(PY) benchmarks/first_step_load.py
	$(PY) benchmarks/warm_start.py
	$(PY) benchmarks/steady_state.py
	$(PY) benchmarks/fsdp.py
	$(PY) benchmarks/real_model.py
	$(PY) benchmarks/repeated_runs.py
	$(PY) benchmarks/ddp_cache.py
	$(PY) benchmarks/generating_eval.py
	$(PY) benchmarks/generating_eval.py --backend inductor --sanity 1
	$(PY) benchmarks/background_compile.py
	$(PY) benchmarks/ddp_split.py
	$(PY) benchmarks/multi_node.py
	$(PY) benchmarks/entry_points.py
	$(PY) benchmarks/demo_noise.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/variable_lengths.py
	$(PY) benchmarks/gate_noise.py
	$(PY) benchmarks/mkl_dynamic.py
	$(PY) benchmarks/status_cost.py

# On a GPU machine: its own python3 and this source tree, nothing installed but the
# wheels of .whl/ when they came along (make gpu-wheels), into a folder of their own. Here
# the venv's python, which finds no GPU and says so (GPU_CHECK_ARGS="--device cpu" runs
# every part small on the CPU instead).
GPU_PY := $(shell test -x $(PY) && echo $(PY) || echo python3)
GPU_WHEELS := .whl
GPU_SITE := /tmp/lightning-regions-gpu-site

gpu-check:
	@if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then \
		$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade \
			--target $(GPU_SITE) $(GPU_WHEELS)/*.whl; fi
	PYTHONPATH=.:$(GPU_SITE) $(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# DeepSpeed for a GPU machine that has no registry and no deepspeed (docs/testing.md):
# its wheel built here without its ops, and the wheels of its needs that machine lacks,
# for its CPython 3.12 on x86-64, at this venv's versions. Carry .whl to it.
GPU_WHEEL_NEEDS := hjson|pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection

gpu-wheels: install
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEELS) \
		-r requirements-deepspeed.txt
	$(PY) -m pip freeze | grep -iE '^($(GPU_WHEEL_NEEDS))==' >$(GPU_WHEELS)/needs.txt
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) -r $(GPU_WHEELS)/needs.txt

clean:
	rm -rf $(VENV) .venv-torch-* .venv-ci-torch .pytest_cache .ruff_cache .hypothesis
