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
# The OpenAI API's tool calls and reasoning, as the default model writes them (vLLM's flags)
OPENAI_FLAGS ?= --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3

.PHONY: install test test-unit test-integration serve model tritonserver bench gpu-wheels clean

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

model: $(STAMP)
	$(PY) -m builder default --repository model_repository

test: $(STAMP) tritonserver
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 tests

test-unit: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

test-integration: $(STAMP) tritonserver
	$(PY) -m pytest -q -p no:cacheprovider tests/integration

serve: $(STAMP) tritonserver model
	exec $(PY) -m clients.tritonserver serve --model-repository model_repository --host $(HOST) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--supervisor-port $(SUPERVISOR_PORT) --openai-port $(OPENAI_PORT) $(OPENAI_FLAGS)

bench: $(STAMP) tritonserver model
	$(PY) -m pip install -q matplotlib
	$(PY) -m clients.bench offline --json docs/offline.json
	$(PY) -m clients.bench serve --start-server --json docs/serve.json --plot docs/throughput_latency.png

# Wheels the device tool's GPU machines lack (pydantic, xgrammar), into .whl/ for them.
gpu-wheels: $(STAMP)
	$(PY) -m clients.gpu_wheels --dest .whl

clean:
	rm -rf $(VENV) third_party model_repository/llm
