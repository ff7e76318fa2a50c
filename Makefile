# The two commands of the README: `make demo` (the main job) and `make test`; and
# `make swap-study`, the swap at the paper's token count (docs/swap_study.md).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test swap-study

setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) tools/train_demo.py

test: setup
	$(PY) -m pytest tests

# About 35 minutes on 2 cores: trains, sweeps and fine-tunes each model (tools/swap_study.py).
swap-study: setup
	$(PY) tools/swap_study.py --work-dir work_dirs/swap_study --fig-dir docs/swap_study --threads 1
