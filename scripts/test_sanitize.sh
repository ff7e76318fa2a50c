#!/usr/bin/env bash
# `make test-sanitize`: the C++ kernel built with AddressSanitizer and UndefinedBehaviorSanitizer
# into build/sanitize (never over the in-place mita_seg/_C*.so), loaded through MITA_C_LIBRARY,
# and the tests that run it (kernel, backward, bias, operator, fuzz, gradients, precision; not
# the `slow` ones) run with the sanitizer runtime preloaded into Python. Any report fails the
# run: halt_on_error, and -fno-sanitize-recover=all makes every UB check fatal.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CXX=${CXX:-g++}
OUT=build/sanitize
MITA_SANITIZE=1 "$PY" setup.py -q build_ext --build-lib "$OUT/lib" --build-temp "$OUT/temp"
LIB=$(ls "$PWD/$OUT"/lib/mita_seg/_C*.so)
# the runtime of the compiler that built it (setup.py builds with g++), before anything else
RUNTIME="$("$CXX" -print-file-name=libasan.so) $("$CXX" -print-file-name=libubsan.so)"
export MITA_C_LIBRARY=$LIB LD_PRELOAD=$RUNTIME
# detect_leaks=0: CPython and torch keep their allocations to the end by design
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
"$PY" -c "from mita_seg.ops.fused_cpu import _C; assert _C.__file__ == '$LIB', _C"
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_fused_kernel.py \
    tests/test_fused_backward.py tests/test_bias.py tests/test_ops.py tests/test_fuzz.py \
    tests/test_gradients.py tests/test_precision.py "$@"
