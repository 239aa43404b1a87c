# One command to serve, one to test. Everything lands in a project-local venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where every port listens: loopback unless asked (HOST=0.0.0.0 exposes them; set API_KEY then).
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
SUPERVISOR_PORT ?= 8003
OPENAI_PORT ?= 9000
MODEL ?=
# The OpenAI API's tool calls and reasoning, as the default model writes them (vLLM's flags)
OPENAI_FLAGS ?= --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3

.PHONY: install test test-setup test-py312 test-unit test-integration serve serve-dynamo model model-random tritonserver dynamo dynamo-services bench docs gpu-wheels gpu-bundle clean

$(STAMP): pyproject.toml requirements/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch first, so nothing below pulls CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

tritonserver: $(STAMP)
	$(PY) -m clients.tritonserver install

# NVIDIA Dynamo (docs/dynamo.md): its Python packages, and the NATS and etcd servers its
# tests start (Debian's packages; installed where this runs as root, as in CI).
DYNAMO_STAMP := $(VENV)/.dynamo-installed
$(DYNAMO_STAMP): $(STAMP) requirements/dynamo.txt
	$(PY) -m pip install -q --no-deps -r requirements/dynamo.txt
	touch $(DYNAMO_STAMP)

dynamo: $(DYNAMO_STAMP) dynamo-services

dynamo-services:
	@if command -v nats-server >/dev/null && command -v etcd >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server etcd-server >/dev/null; \
	else echo "dynamo-services: install the Debian packages nats-server and etcd-server for the Dynamo tests"; fi

# The model `make serve` serves (the trained reference model: its answers end on their own),
# as a repository of its own in model_repository/. The benchmarks build the random-weight
# default they rely on (it never stops early).
model: $(STAMP)
	$(PY) -m builder default --trained --repository model_repository

model-random: $(STAMP)
	$(PY) -m builder default --repository model_repository

# The suite runs in two lanes at once, as CI has two cores. Lane B takes the integration
# modules whose servers are their own (the session's server, which lane A's use, starts
# in lane A only) and five unit folders; lane A takes everything else, so that a new test
# file needs no list. Lane A runs the integration modules first (pytest's order), lane B
# its unit folders first: a lane waiting on a server's start or a fault's timeout then
# leaves its core to the other's computing, not to another wait. The lanes are about equal
# (docs/development.md has their times).
LANE_B := $(addprefix tests/unit/,parallel builder attention models ops) \
	$(addprefix tests/integration/test_,recovery.py trtllm_contract.py \
	tensor_parallel_serving.py fp8_serving.py graph_serving.py speculative_serving.py stress.py \
	dynamo_serving.py dynamo_disagg.py cli.py)
# Each lane's temporary files (server logs included) and its JUnit report (every test's
# time: lane-a.xml, lane-b.xml) stay here until the next run.
TEST_TMP ?= /tmp/paged_llm-tests
PYTEST := PYTHONUNBUFFERED=1 $(PY) -m pytest -q -p no:cacheprovider --durations=15
# The setup first, two jobs at once: the main install is one process that leaves the
# second core idle, which the Python 3.12 check and the Dynamo services then use.
test:
	@$(MAKE) --no-print-directory -j2 test-setup
	@set -u; mkdir -p $(TEST_TMP); \
	( $(PYTEST) --basetemp=$(TEST_TMP)/lane-a --junitxml=$(TEST_TMP)/lane-a.xml $(addprefix --ignore=,$(LANE_B)) tests 2>&1 \
	  | sed -u 's/^/A| /'; \
	  exit $${PIPESTATUS[0]} ) & a=$$!; \
	( $(PYTEST) --basetemp=$(TEST_TMP)/lane-b --junitxml=$(TEST_TMP)/lane-b.xml $(LANE_B) 2>&1 | sed -u 's/^/B| /'; \
	  exit $${PIPESTATUS[0]} ) & b=$$!; \
	wait $$a; ra=$$?; wait $$b; rb=$$?; echo "make test: lane A exited $$ra, lane B $$rb"; \
	test $$ra -eq 0 && test $$rb -eq 0

test-setup: $(STAMP) tritonserver dynamo test-py312

# NVIDIA's image (tritonserver:25.08-py3) runs Python 3.12: every module must compile under
# it, and the launcher's parts that need no torch (supervisor sidecars and status port, the
# HTTP guard, the JSON depth check) pass their tests under it. The full suite runs on 3.11.
# (pyenv's shim for python3.12 fails unless 3.12 is selected: take the interpreter itself.)
PY312 ?= $(firstword $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.12*/bin/python3.12) python3.12)
test-py312:
	@if ! $(PY312) -c pass >/dev/null 2>&1; then echo "test-py312: no Python 3.12 here: skipped"; exit 0; fi; \
	set -e; test -x .venv312/bin/python || $(PY312) -m venv .venv312; \
	.venv312/bin/python -m pip install -q numpy==1.26.4 aiohttp==3.14.5 "pytest>=8" pytest-timeout "hypothesis>=6"; \
	.venv312/bin/python -m compileall -q -x '/(\.venv|third_party)' backend builder clients benchmarks frontend supervisor tests; \
	.venv312/bin/python -m pytest -q -p no:cacheprovider --noconftest tests/unit/supervisor/test_sidecars.py \
		tests/unit/supervisor/test_status.py tests/unit/frontend/test_http_guard.py tests/unit/frontend/test_json_depth.py

test-unit: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

test-integration: $(STAMP) tritonserver
	$(PY) -m pytest -q -p no:cacheprovider tests/integration

# `paged-llm serve` (clients/cli.py): MODEL, a Hugging Face folder, or by default the trained
# reference model, built once into the cache with TensorRT-LLM's three models in front.
serve: $(STAMP) tritonserver
	exec $(PY) -m clients.cli serve $(MODEL) --trtllm-models --host $(HOST) --port $(OPENAI_PORT) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--supervisor-port $(SUPERVISOR_PORT) $(OPENAI_FLAGS)

# The default model under NVIDIA Dynamo on this machine (docs/dynamo.md): NATS, etcd,
# DYNAMO_WORKERS of our workers, Dynamo's KV-routing frontend, and with API_KEY set our
# guard in front of it, on HOST:DYNAMO_PORT.
DYNAMO_PORT ?= 8080
DYNAMO_WORKERS ?= 2
serve-dynamo: $(STAMP) dynamo model
	exec $(PY) -m clients.dynamo_local --model-repository model_repository --host $(HOST) \
		--port $(DYNAMO_PORT) --workers $(DYNAMO_WORKERS) --router-mode kv

bench: $(STAMP) tritonserver model-random
	$(PY) -m pip install -q matplotlib
	$(PY) -m benchmarks.bench offline --json docs/offline.json
	$(PY) -m benchmarks.bench serve --start-server --json docs/serve.json --plot docs/throughput_latency.png

# The documentation site, served locally (its references first rewritten from the code).
docs: $(STAMP)
	$(PY) -m tools.docs_reference
	$(PY) -m mkdocs serve -a 127.0.0.1:8008

# Wheels the device tool's GPU machines lack (pydantic, xgrammar), into .whl/ for them.
gpu-wheels: $(STAMP) $(DYNAMO_STAMP)
	$(PY) -m benchmarks.gpu_wheels --dest .whl

# What issue 50's two device calls carry (benchmarks/gpu_bundle.py): .gpu/perf and .gpu/serve.
gpu-bundle: $(STAMP) tritonserver
	$(PY) -m benchmarks.gpu_bundle

clean:
	rm -rf $(VENV) .venv312 third_party model_repository/llm
