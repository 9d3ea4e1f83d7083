# Set-up and entry points. `make demo` and `make test` work on a fresh machine: each creates the
# virtual environment (.venv) with the pinned dependencies first.
#   TORCH_SPEC: how torch is installed. Default: torch 2.13.0 from pip's configured index (a CPU build where that
#   index serves one; from pypi.org on Linux it brings the CUDA libraries: add
#   --index-url https://download.pytorch.org/whl/cpu). For a CUDA build, e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= output/demo
MONAILABEL_VENV ?= .venv-monailabel
# the server tests (tests/test_monailabel*.py) run the app with this interpreter
MONAILABEL_PYTHON ?= $(abspath $(MONAILABEL_VENV))/bin/python
PYTEST_ARGS ?= -q
# pytest-xdist workers; each test file runs whole, in order, on one worker (module servers and fixtures stay shared)
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: install monailabel package demo demo-train demo-evaluate demo-3d lint test test-fast test-zoo-pins benchmark clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-3d.txt requirements-xfeat.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-3d.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-xfeat.txt
	touch $@

# MONAI Label server in its own environment (CPU torch and numpy of .venv kept; see docs in README)
monailabel: $(MONAILABEL_VENV)/.installed

$(MONAILABEL_VENV)/.installed: $(VENV)/.installed requirements-monailabel.txt
	bash apps/monailabel/install.sh $(VENV) $(MONAILABEL_VENV)
	touch $@

# the versions the model zoo installs (configs/metadata.json: those with Python 3.10 wheels, scripts/zoo_ci.py), tested:
# .venv-zoo-pins holds the pins that differ from requirements.txt over .venv's packages, and runs the zoo's unit test
# (ci/unit_tests) and the report, console and image-option tests with them
ZOO_PINS_VENV ?= .venv-zoo-pins
test-zoo-pins: install
	$(PYTHON) -m venv $(ZOO_PINS_VENV)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(ZOO_PINS_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/project_venv.pth"
	$(ZOO_PINS_VENV)/bin/pip install --quiet --no-deps $$($(PY) -c "from scripts.zoo_ci import PY310_WHEELS as z; \
		import importlib.metadata as m; print(' '.join(f'{k}=={v}' for k, v in z.items() if m.version(k).split('+')[0] != v))")
	MONAILABEL_PYTHON=$(MONAILABEL_PYTHON) $(ZOO_PINS_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/test_zoo_unit.py \
		tests/test_reporting.py tests/test_console.py tests/test_images_option.py

package: install
	$(PY) -m scripts.package --output_dir dist

demo: demo-train demo-evaluate

demo-train: install
	$(PY) -m monai.bundle run training --config_file configs/train.yaml \
		--output_dir $(DEMO_DIR)

demo-evaluate: install
	$(PY) -m monai.bundle run evaluating --config_file "['configs/train.yaml','configs/evaluate.yaml']" \
		--output_dir $(DEMO_DIR)/eval --ckpt_path $(DEMO_DIR)/models/model.pt --pipeline templates

demo-3d: install
	$(PY) -m monai.bundle run training --config_file "['configs/train.yaml','configs/train_3d.yaml']" \
		--output_dir $(DEMO_DIR)_3d --epoch_length 15
	$(PY) -m monai.bundle run evaluating \
		--config_file "['configs/train.yaml','configs/train_3d.yaml','configs/evaluate.yaml']" \
		--output_dir $(DEMO_DIR)_3d/eval --ckpt_path $(DEMO_DIR)_3d/models/ct3d/model.pt --pipeline templates

# the lint gate: ruff's checks and formatting (pyproject.toml [tool.ruff]); `ruff format .` fixes the latter
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: install monailabel lint
	MONAILABEL_PYTHON=$(MONAILABEL_PYTHON) $(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS) tests

# the suite without the end-to-end trainings and servers (pytest marker "slow")
test-fast: install lint
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS) -m "not slow" tests

benchmark: install
	$(PY) -m scripts.benchmark all

clean:
	rm -rf output dist .pytest_cache
