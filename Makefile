# tokenloom: `make serve` starts the server on the default model, `make test` runs every test.
# Each target creates .venv when missing and installs what it needs (CPU torch from the
# wheel on disk, the default model converted once into ~/.cache/tokenloom, the CPU kernels
# compiled once into the same cache).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= smollm2
PORT ?= 8000

.PHONY: setup browser model kernels test test-fast demo serve bench clean

$(STAMP): requirements-cpu.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP) browser

# Chromium and chromedriver from Debian's packages for the browser tests (skipped when present).
browser:
	sh scripts/install_chromium.sh

model: $(STAMP)
	$(PY) -m engine.loader.model_files $(MODEL)

# The C++ CPU kernels, compiled once per machine (engines fall back to torch without a compiler),
# the int8 and int4 matmuls where the CPU has AVX512_VNNI, and the GGUF block kernels (AVX2).
kernels: $(STAMP)
	$(PY) -m engine.cpu.extension
	$(PY) -m engine.cpu.quantized_extension
	$(PY) -m engine.cpu.gguf_extension

test: model kernels browser
	$(PY) -m pytest -q -rs --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: model kernels
	$(PY) -m scripts.demo --model $(MODEL)

serve: model kernels
	$(PY) -m frontend.cli serve --model $(MODEL) --port $(PORT)

bench: model kernels
	$(PY) -m scripts.bench.offline --json results/bench_offline.json

clean:
	rm -rf $(VENV) .pytest_cache
