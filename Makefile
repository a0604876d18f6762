# make train   set up (first time), train the embedded default (tiny GPT, 2 CPU processes or all GPUs), sample it
# make test    set up (first time) and run the test suite (CPU; GPU tests run when a GPU is present)
# make test-fast  the fast tier (< 5 min on 2 cores): configs, the model seam, tp2/pp2 equivalence, one launch
# make setup   create .venv with the pinned versions (constraints.txt), the test, HF, W&B, data, lm-eval, bench and post extras
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
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,hf,wandb,data,lmeval,bench,post]"
	$(PY) -m pip install --quiet --no-deps -c constraints.txt torchtitan  # tools/bench.py --compare's peer
	touch $(STAMP)

SAMPLE_PROMPT ?= The import statement
train: setup
	@run_dir=$${RUN_DIR:-outputs/$$(date +%Y-%m-%d/%H-%M-%S)}; \
	RUN_DIR=$$run_dir launch/train.sh $(ARGS) || exit $$?; \
	if [ -f $$run_dir/checkpoints/latest ]; then \
	  echo "--- a sample of the trained model ($$run_dir/checkpoints):"; \
	  $(PY) tools/generate.py --ckpt $$run_dir/checkpoints --prompt "$(SAMPLE_PROMPT)" --max-new-tokens 160 \
	    --temperature 0.8 --top-k 20 --seed 1 2>/dev/null && \
	  echo "--- more: $(PY) tools/generate.py --ckpt $$run_dir/checkpoints --prompt 'Your text' --max-new-tokens 400"; \
	fi

test: setup
	$(PY) -m pytest -q -ra --durations=15 tests

test-fast: setup
	$(PY) -m pytest -q -ra --durations=10 -m fast tests

clean:
	rm -rf $(VENV) .cache outputs
