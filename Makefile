# `make test`: every test, Rust and Python, on a machine with only Rust and Python 3.11.
# The first run creates .venv here and installs what the Python tests need from PyPI (~2 min);
# later runs reuse it. `make demo` runs the main job on built-in defaults; `make train` trains the
# example GPT through Tessera (examples/README.md), after installing the example's extras;
# `make train-jax` trains the same GPT in plain JAX through tessera.jax.attention.

VENV ?= .venv
PY := $(VENV)/bin/python
PY_DEPS := numpy torch jax pytest maturin ml_dtypes safetensors flatbuffers

.PHONY: test test-rust test-python python-package demo train train-jax

test: test-rust test-python

test-rust:
	cargo test --workspace --release

test-python: python-package
	$(PY) -m pytest bindings/python/tests -q

# The package, built from this checkout into the venv (maturin from the venv: no build isolation).
python-package: $(VENV)/.deps
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pip install -q --no-cache-dir --no-build-isolation ./bindings/python

# Re-run when this file changes (a new test dependency reaches existing venvs too). No pip cache:
# torch's wheels with their CUDA libraries are ~4 GB, and a cached copy beside the installed one
# filled a CI machine's disk.
$(VENV)/.deps: Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-cache-dir --upgrade pip
	$(PY) -m pip install -q --no-cache-dir $(PY_DEPS)
	touch $@

demo:
	cargo run --release -- demo

# The CLI draws the telemetry pictures, so it is built too.
train: python-package
	$(PY) -m pip install -q -r examples/requirements.txt
	cargo build --release
	$(PY) examples/train_gpt.py

# The same GPT in plain JAX through tessera.jax.attention, with the same extras and pictures.
train-jax: python-package
	$(PY) -m pip install -q -r examples/requirements.txt
	cargo build --release
	$(PY) examples/train_gpt_jax.py
