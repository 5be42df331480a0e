# `make test`: every test, Rust and Python, on a machine with only Rust and Python 3.11.
# The first run creates .venv here and installs what the Python tests need from PyPI (~2 min);
# later runs reuse it. `make demo` runs the main job on built-in defaults; `make train` trains the
# example GPT through Tessera (examples/README.md), after installing the example's extras;
# `make train-jax` trains the same GPT in plain JAX through tessera.jax.attention.
# `make test-xla` runs the torch_xla suite (docs/torch-xla.md) in its own environment beside
# .venv: torch 2.9, torch_xla 2.9 and jax 0.7.1 (the torch_xla[pallas] pins), the package installed
# from the one abi3 wheel `make wheel` builds. PJRT runs on the CPU client; `make test` skips it.

VENV ?= .venv
PY := $(VENV)/bin/python
PY_DEPS := numpy torch jax pytest maturin ml_dtypes safetensors flatbuffers

.PHONY: test test-rust test-python python-package demo train train-jax test-xla wheel

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

# The one abi3 wheel (every CPython >= 3.9 on x86-64 Linux); installs without a Rust toolchain.
WHEEL_DIR := bindings/python/target/wheels
wheel: $(VENV)/.deps
	rm -f $(WHEEL_DIR)/tessera-*.whl
	$(VENV)/bin/maturin build --release -m bindings/python/Cargo.toml -o $(WHEEL_DIR)

XLA_VENV ?= .venv-xla
XLA_PY := $(XLA_VENV)/bin/python
# torch_xla 2.9's wheel is one for CPU and TPU; its call_jax needs torchax, whose current release
# imports flax. The jax pins are torch_xla[pallas]'s.
XLA_DEPS := torch==2.9.0 torch_xla==2.9.0 jax==0.7.1 jaxlib==0.7.1 torchax flax pytest numpy ml_dtypes

$(XLA_VENV)/.deps: Makefile
	python3 -m venv $(XLA_VENV)
	$(XLA_PY) -m pip install -q --no-cache-dir --upgrade pip
	$(XLA_PY) -m pip install -q --no-cache-dir $(XLA_DEPS)
	touch $@

test-xla: $(XLA_VENV)/.deps wheel
	$(XLA_PY) -m pip install -q --no-deps --force-reinstall $(WHEEL_DIR)/tessera-*.whl
	PJRT_DEVICE=CPU TESSERA_WHEEL="$$(ls $(WHEEL_DIR)/tessera-*.whl)" $(XLA_PY) -m pytest -q \
		bindings/python/tests/test_torch_xla.py $(XLA_ALSO)

# The oldest supported torch and JAX run the CPU ops' suites too (the package's version floor).
XLA_ALSO := $(addprefix bindings/python/tests/,test_torch_attention.py test_jax_attention.py \
	test_jax_splash.py test_masks_plans.py)
