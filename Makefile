# `make test`: every test, Rust and Python, on a machine with only Rust and Python 3.11.
# The first run creates .venv here and installs what the Python tests need from PyPI (~2 min);
# later runs reuse it. `make demo` runs the main job on built-in defaults.

VENV ?= .venv
PY := $(VENV)/bin/python
PY_DEPS := numpy torch jax pytest maturin ml_dtypes

.PHONY: test test-rust test-python python-package demo

test: test-rust test-python

test-rust:
	cargo test --workspace --release

test-python: python-package
	$(PY) -m pytest bindings/python/tests -q

# The package, built from this checkout into the venv (maturin from the venv: no build isolation).
python-package: $(VENV)/.deps
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pip install -q --no-build-isolation ./bindings/python

$(VENV)/.deps:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PY_DEPS)
	touch $@

demo:
	cargo run --release -- demo
