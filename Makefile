# make train   set up (first time) and train the embedded default (tiny GPT, 2 CPU processes or all GPUs)
# make test    set up (first time) and run the test suite (CPU; GPU tests run when a GPU is present)
# make test-fast  the fast tier (< 5 min on 2 cores): configs, the model seam, tp2/pp2 equivalence, one launch
# make setup   create .venv with the pinned versions (constraints.txt), the test and Hugging Face extras
# Extra training overrides: make train ARGS="parallel.tp=2 train.iters=50"
PYTHON_BIN ?= $(shell tools/find_python.sh)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PYTHON_BIN)" || { echo "error: no Python >= 3.12 found: set PYTHON_BIN=/path/to/python3.12"; exit 1; }
	$(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,hf]"
	touch $(STAMP)

train: setup
	launch/train.sh $(ARGS)

test: setup
	$(PY) -m pytest -q -ra --durations=15 tests

test-fast: setup
	$(PY) -m pytest -q -ra --durations=10 -m fast tests

clean:
	rm -rf $(VENV) .cache outputs
