# The two commands of the README: `make demo` (the main job) and `make test`. `make test`
# skips the long end-to-end runs (marked `slow`); `make test-slow` runs them; CI runs both.
# `make swap-study`: the swap at the paper's token count, 3 seeds (docs/swap_study.md).
# `make test-sanitize`: the C++ kernel built with AddressSanitizer + UBSan into build/sanitize
# and its tests run against it (scripts/test_sanitize.sh); CI runs it after `make test`.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-slow test-sanitize swap-study

setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) tools/train_demo.py

# a pytest-xdist worker per core, each test file on one worker (its module fixtures built once)
test: setup
	$(PY) -m pytest tests -m "not slow" -n auto --dist loadfile

test-slow: setup
	$(PY) -m pytest tests -m slow

test-sanitize: setup
	PY=$(PY) bash scripts/test_sanitize.sh

# About 55 minutes on 2 cores, one thread: trains, sweeps (ToMe, MiTA, calibrated plans),
# fine-tunes each model, trains the Segmenter with MiTA (tools/swap_study.py runs the
# experiment in projects/swap_study/; --reuse keeps the models and checkpoints already
# computed in the work dir).
swap-study: setup
	$(PY) tools/swap_study.py --work-dir work_dirs/swap_study --fig-dir docs/swap_study --threads 1

# The study's tables in docs/swap_study.md, docs/longrange_data.md and README.md, regenerated from the JSON committed
# under docs/swap_study/ (seconds, no training; tests/test_swap_study.py checks they match).
.PHONY: study-docs
study-docs:
	$(PY) tools/study_docs.py

# The README's speed table from the committed benchmark record (mita_seg/benchmark/docs.py)
.PHONY: bench-docs
bench-docs:
	$(PY) tools/bench_docs.py
