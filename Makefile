# The two commands of the README: `make demo` (the main job) and `make test`. `make test`
# skips the long end-to-end runs (marked `slow`); `make test-slow` runs them; CI runs both.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-slow

setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) tools/train_demo.py

test: setup
	$(PY) -m pytest tests -m "not slow"

test-slow: setup
	$(PY) -m pytest tests -m slow
