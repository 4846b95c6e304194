# The README's two commands are `make run` and `make test`; the other targets are their parts.
# CI (.ci/run) runs `make lint typecheck test`: ruff's lint and format check, mypy, then the suite.
#
# Setup is idempotent: the venv is installed once per content of the pyproject files (a stamp
# keyed on their hash), so a second `make test` goes straight to pytest.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
EXTRAS := gateway,observability,quantize,dev
CLIENT := clients/python
INSTALL_KEY := $(shell cat pyproject.toml $(wildcard $(CLIENT)/pyproject.toml) | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(INSTALL_KEY)

# `make run ARGS="--max-total-tokens 1024"` passes flags to `inference-service launch`
# (the gRPC server and TGI's REST API through Envoy on :8080).
ARGS ?=
# `make test PYTEST_ARGS="-m 'not slow'"` passes options to pytest.
PYTEST_ARGS ?=
# What `make typecheck` checks (those of them that exist).
TYPECHECKED := $(wildcard inference_service/engine inference_service/sample inference_service/worker inference_service/frontend)

.PHONY: run test setup browser fuzz protos protos-check demo-model lint typecheck clean

run: setup protos demo-model
	$(VENV)/bin/inference-service launch $(ARGS)

test: setup browser
	$(PY) -m pytest $(PYTEST_ARGS)

setup: $(STAMP)

# The full fuzz run (about 12,000 cases, a few minutes; `make test` runs 60 per operation): the gRPC
# API (tests/fuzz) and the REST routes through Envoy from /openapi.json (tests/e2e/test_rest_fuzz.py).
fuzz: setup
	FUZZ_EXAMPLES=1700 $(PY) -m pytest -s tests/fuzz
	FUZZ_EXAMPLES=200 $(PY) -m pytest -s tests/e2e/test_rest_fuzz.py

# Debian's Chromium, for the test that opens /docs headless (skipped here when it is already there).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || $(SUDO) apt-get install -y -q chromium >/dev/null 2>&1 \
		|| ($(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q chromium >/dev/null) \
		|| echo "could not install Debian's chromium: the /docs browser test will fail"

# torch first, from the pinned CPU build, so that nothing later can pull a CUDA build.
# The `text-generation` client pins huggingface-hub<1.0 (transformers needs >=1.0): it goes in
# with --no-deps, its real needs (pydantic, aiohttp) come with the dev extra.
$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	$(PIP) install --quiet --no-deps text-generation==0.7.0
	if [ -f $(CLIENT)/pyproject.toml ]; then $(PIP) install --quiet --no-deps -e $(CLIENT); fi
	rm -f $(VENV)/.installed-*
	touch $@

# Stubs, type stubs, the Envoy descriptor set, the OpenAPI document, the standalone Envoy config that embeds it and the Kubernetes
# manifests (all committed).
protos: setup
	$(PY) protos/generate.py
	$(PY) -m gateway.openapi --output protos/textgen/openapi.json
	$(PY) -m gateway --output deploy/envoy/envoy.yaml
	$(PY) -m gateway.k8s --output-dir deploy/k8s

protos-check: setup
	$(PY) protos/generate.py --check

demo-model: setup
	$(PY) -m inference_service.models.demo

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: setup
	$(PY) -m mypy $(TYPECHECKED)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

# The engine, serving, prefix-cache and speculation benchmarks in quick mode (a tiny random model, about a minute): a CI
# smoke run, no thresholds.
# Full runs: see benchmarks/README.md.
.PHONY: bench-quick
bench-quick: setup
	$(PY) benchmarks/engine_bench.py --quick
	$(PY) benchmarks/serve_bench.py --quick
	$(PY) benchmarks/prefix_cache_bench.py --quick
	$(PY) benchmarks/speculation_bench.py --quick
