# Set-up and entry points. `make demo` and `make test` work on a fresh machine: each creates the
# virtual environment (.venv) with the pinned dependencies first.
#   TORCH_SPEC: how torch is installed. Default: the CPU build. For a CUDA build, e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= output/demo
PYTEST_ARGS ?= -q

.PHONY: install demo demo-train demo-evaluate test benchmark clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

demo: demo-train demo-evaluate

demo-train: install
	$(PY) -m monai.bundle run training --config_file configs/train.yaml \
		--output_dir $(DEMO_DIR) --ckpt_dir $(DEMO_DIR)/models

demo-evaluate: install
	$(PY) -m monai.bundle run evaluating --config_file "['configs/train.yaml','configs/evaluate.yaml']" \
		--output_dir $(DEMO_DIR)/eval --ckpt_path $(DEMO_DIR)/models/model.pt

test: install
	$(PY) -m pytest $(PYTEST_ARGS) tests

benchmark: install
	$(PY) scripts/benchmark.py all

clean:
	rm -rf output .pytest_cache
