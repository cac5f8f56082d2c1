# Both entry points create .venv and install what they need; torch is pinned (constraints.txt) to the CPU build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Bytecode is written as modules are first imported (many machines set PYTHONDONTWRITEBYTECODE=1, and then every
# process compiles torch's and transformers' modules again); so pip compiles nothing up front (--no-compile: ~25 s
# of set-up, most of it modules no process here ever imports).
export PYTHONDONTWRITEBYTECODE :=
PDSERVE_HOME ?= $(HOME)/.cache/pdserve
DEMO_MODEL := $(PDSERVE_HOME)/models/qwen3-tiny-s0

.PHONY: demo test install bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile -c constraints.txt torch==2.13.0
	$(PIP) install -q --no-compile -c constraints.txt -e '.[test]'
	$(PIP) install -q --no-compile --no-deps nixl-cu12==1.5.1 nixl==1.5.1  # NixlConnector (its torch dependency: see pyproject)
	touch $@

install: $(VENV)/.installed

# The seed's experiment on the tiny model: collocated vs 1P1D (strict rule) vs 1P1D (default rule), three rates.
DEMO_ARGS ?= --rates 2,8,32 --num-prompts 24 --random-input-len 128 --random-output-len 32
demo: $(VENV)/.installed
	$(PY) -m pdserve.cli make-model --arch qwen3 --size tiny --out $(DEMO_MODEL) --if-missing
	$(PY) -m pdserve.cli bench pd --model $(DEMO_MODEL) $(DEMO_ARGS) --result-dir bench-results/demo

# The layers contract (pyproject.toml) and the linter first: an upward import or a lint error fails the run.
test: $(VENV)/.installed
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check pdserve tests benchmarks
	$(PY) -m pytest -q --durations=15  # the slowest 15 in the log: the suite must stay under CI's 15 minutes

bench: $(VENV)/.installed
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
