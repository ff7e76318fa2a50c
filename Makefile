# The two commands of the README: `make demo` (the main job) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test

setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) tools/train_demo.py

test: setup
	$(PY) -m pytest tests
