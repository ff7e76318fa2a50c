"""Timing and memory of calls, and the machine they ran on: the helpers
``tools/benchmark.py`` and the swap study share (torch and the standard library only).

- :func:`median_time`: ``torch.utils.benchmark.Timer`` on torch's thread count, the median;
- :func:`interleaved_medians`: several variants timed in turn, one call of each per round,
  so a shared host's drift falls on all of them alike and their ratios hold;
- :func:`peak_memory_rise`: how far peak memory rose during one call (the process's peak
  RSS on CPU, CUDA's peak allocated memory on a GPU);
- :func:`steady_allocator`: glibc's allocator as a long-running process has it, while timing
  in a process that lowered its mmap threshold for exact memory peaks;
- :func:`cpu_description`: the CPU in words, e.g. ``AMD EPYC (family 25 model 1, Zen 3),
  2 vCPUs under KVM, AVX2, no AVX-512, no AMX``.
"""
import contextlib
import ctypes
import gc
import os
import statistics
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.benchmark import Timer

__all__ = ['MMAP_ENV', 'median_time', 'interleaved_medians', 'peak_memory_rise',
           'steady_allocator', 'cpu_description', 'cpu_tag', 'machine']

# glibc reads its mmap threshold from this variable at start-up: a benchmark sets it low
# (and re-executes itself) so that freed buffers go back to the OS and peaks are exact.
MMAP_ENV = 'MALLOC_MMAP_THRESHOLD_'

# glibc's mallopt parameters and the values of a running process's steady state.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_STEADY_MMAP, _STEADY_TRIM = 32 * 2**20, 64 * 2**20
_DEFAULT_TRIM = 128 * 1024


@contextlib.contextmanager
def steady_allocator():
    """glibc's allocator as a process that runs a model again and again has it.

    glibc raises its mmap threshold to the size of each mmapped buffer freed (up to 32 MiB)
    and its trim threshold to twice that, so after its first calls a process reuses freed
    buffers below 32 MiB instead of mapping (and page-faulting) them afresh. A process that
    lowered the threshold through :data:`MMAP_ENV` for exact memory peaks would charge those
    page faults to every timed call: inside this block the thresholds are at their steady
    values, afterwards back to the low one with the freed memory returned (``malloc_trim``).
    A no-op where the threshold was not lowered or glibc is not the C library.
    """
    low = int(os.environ.get(MMAP_ENV) or 0)
    try:
        libc = ctypes.CDLL('libc.so.6') if low else None
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        libc = None
    if libc is None:
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP)
    mallopt(_M_TRIM_THRESHOLD, _STEADY_TRIM)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, low)
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
        trim(0)


def median_time(fn: Callable[[], Any], min_run_time: float = 1.0) -> float:
    """Median seconds per call of ``fn()`` (``torch.utils.benchmark.Timer``'s
    ``blocked_autorange``, which synchronises an accelerator around each measurement),
    after one warm-up call, on torch's thread count (``Timer`` runs single-threaded unless
    told), with the allocator of :func:`steady_allocator`.

    Args:
        fn (Callable): the call to time.
        min_run_time (float): seconds of repeated calls at least. Default: 1.0.
    """
    with steady_allocator():
        fn()  # lazy initialisation and the buffers of the steady state
        return Timer('fn()', globals={'fn': fn}, num_threads=torch.get_num_threads()
                     ).blocked_autorange(min_run_time=min_run_time).median


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and device.type == 'cuda':
        torch.cuda.synchronize(device)


def interleaved_medians(fns: Sequence[Callable[[], Any]], min_run_time: float = 0.0,
                        rounds: int = 3, device: Optional[torch.device] = None,
                        warmup: bool = True, pause: float = 0.0) -> List[float]:
    """Median seconds per call of each of ``fns``, timed in turn: one call of each per
    round, at least ``rounds`` rounds, and more until their calls together have run
    ``min_run_time`` seconds per variant (the time timing each alone for ``min_run_time``
    would take: a fast variant beside a slow one gets as many calls as the slow one, not
    ``min_run_time`` of its own). Calls on a shared host drift; timed one after the other,
    the ratios of variants would carry that drift, interleaved they see the same load.

    Args:
        fns (Sequence[Callable]): the variants, each a call without arguments.
        min_run_time (float): seconds of calls per variant, on average over the variants,
            at least. Default: 0.
        rounds (int): rounds at least. Default: 3.
        device (torch.device, optional): synchronised around each call where it is a CUDA
            device. Default: None.
        warmup (bool): call each once first (not timed), within the allocator of
            :func:`steady_allocator` as the timed calls. Default: True.
        pause (float): seconds of sleep before each timed call, so that the threads of the
            variant before go idle (ONNX Runtime's sessions each spin their own thread
            pool after a run, and would take the cores from the next one). Default: 0.

    Returns:
        list[float]: the median of each, in the order of ``fns``.
    """
    if rounds < 1:
        raise ValueError(f'rounds must be >= 1, got {rounds}')
    times: List[List[float]] = [[] for _ in fns]
    with steady_allocator():
        if warmup:
            for fn in fns:
                fn()
                _sync(device)
        while len(times[0]) < rounds or sum(map(sum, times)) < min_run_time * len(fns):
            for fn, t in zip(fns, times):
                _sync(device)
                if pause:
                    time.sleep(pause)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _proc_status_mib(key: str) -> Optional[float]:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return None


def peak_memory_rise(fn: Callable[[], Any], device: Optional[torch.device] = None,
                     warmup: bool = True) -> Tuple[Any, Optional[float]]:
    """Run ``fn`` once to warm up (lazy initialisation, first-call allocations), then once
    measured; return its result and the rise of peak memory in MiB during that call.

    On CUDA it is the rise of ``torch.cuda.max_memory_allocated``; on CPU the rise of the
    process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``), None where that
    is not available. The RSS is exact for buffers that glibc maps afresh: lower its mmap
    threshold (:data:`MMAP_ENV`) at process start, and measure before any timing in
    :func:`steady_allocator` (after it, glibc keeps memory that later peaks reuse unseen).

    Args:
        fn (Callable): the call.
        device (torch.device, optional): where ``fn`` allocates. Default: CPU.
        warmup (bool): call ``fn`` once before the measured call. Default: True.
    """
    device = torch.device('cpu') if device is None else device
    if warmup:
        fn()
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, (torch.cuda.max_memory_allocated(device) - before) / 2**20
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')  # reset VmHWM to the current RSS
    except OSError:
        return fn(), None
    before = _proc_status_mib('VmRSS:')
    out = fn()
    peak = _proc_status_mib('VmHWM:')
    return out, None if before is None or peak is None else peak - before


# AMD family 0x19 (25) models by microarchitecture (AMD's revision guides): the rest of the
# family is Zen 3. Family 0x1A (26) is Zen 5, 0x17 (23) Zen/Zen+ below model 0x30, Zen 2 above.
_ZEN4_MODELS_19H = ((0x10, 0x1f), (0x60, 0x7f), (0xa0, 0xaf))


def _amd_core(family: int, model: int) -> Optional[str]:
    if family == 23:
        return 'Zen 2' if model >= 0x30 else 'Zen'
    if family == 25:
        return 'Zen 4' if any(a <= model <= b for a, b in _ZEN4_MODELS_19H) else 'Zen 3'
    if family == 26:
        return 'Zen 5'
    return None


# Intel family 6 server models (Intel's model numbers): model 85 is Skylake-SP, Cascade Lake
# and Cooper Lake alike, told apart only by stepping.
_INTEL_XEON_MODELS = {85: 'Skylake-SP/Cascade Lake', 106: 'Ice Lake-SP', 108: 'Ice Lake-D',
                      143: 'Sapphire Rapids', 207: 'Emerald Rapids', 173: 'Granite Rapids',
                      175: 'Sierra Forest'}


def _core(vendor: str, family: int, model: int) -> Optional[str]:
    """The core generation of a CPU's vendor, family and model, where known."""
    if vendor == 'AuthenticAMD':
        return _amd_core(family, model)
    if vendor == 'GenuineIntel' and family == 6:
        return _INTEL_XEON_MODELS.get(model)
    return None


def _cpuinfo() -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    info: Dict[str, str] = {}
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if not line.strip():
                    if info:
                        break
                    continue
                key, _, value = line.partition(':')
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def _hypervisor() -> Optional[str]:
    """lscpu's ``Hypervisor vendor`` (e.g. KVM), or None."""
    try:
        out = subprocess.run(['lscpu'], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith('Hypervisor vendor:'):
            return line.split(':', 1)[1].strip() or None
    return None


def vector_units(flags: Sequence[str]) -> str:
    """The widest vector and matrix units of a CPU's ``flags`` (``/proc/cpuinfo``), and the
    absence of the ones kernels care about, e.g. ``AVX2, no AVX-512, no AMX`` or
    ``AVX-512 (BF16, VNNI), AMX (BF16)``."""
    flags = set(flags)
    parts = []
    if 'avx512f' in flags:
        extra = [n for f, n in (('avx512_bf16', 'BF16'), ('avx512_fp16', 'FP16'),
                                ('avx512_vnni', 'VNNI')) if f in flags]
        parts.append('AVX-512' + (f" ({', '.join(extra)})" if extra else ''))
    else:
        parts.append('AVX2' if 'avx2' in flags else 'AVX' if 'avx' in flags else 'no AVX')
        parts.append('no AVX-512')
    if 'amx_tile' in flags:
        extra = [n for f, n in (('amx_bf16', 'BF16'), ('amx_fp16', 'FP16'),
                                ('amx_int8', 'INT8')) if f in flags]
        parts.append('AMX' + (f" ({', '.join(extra)})" if extra else ''))
    else:
        parts.append('no AMX')
    return ', '.join(parts)


def cpu_description() -> str:
    """The CPU in words, from ``/proc/cpuinfo`` (and lscpu's hypervisor vendor): its name,
    family and model (with the core generation where known: AMD's Zen, Intel's Xeons), the
    logical CPUs (vCPUs under a hypervisor) and the vector units, e.g. ``AMD EPYC (family 25
    model 1, Zen 3), 2 vCPUs under KVM, AVX2, no AVX-512, no AMX``. Falls back to
    ``platform.processor()`` where there is no ``/proc/cpuinfo``."""
    import platform
    info = _cpuinfo()
    name = info.get('model name') or platform.processor() or 'unknown CPU'
    where = []
    if 'cpu family' in info and 'model' in info:
        family, model = int(info['cpu family']), int(info['model'])
        core = _core(info.get('vendor_id', ''), family, model)
        where.append(f'family {family} model {model}' + (f', {core}' if core else ''))
    flags = info.get('flags', '').split()
    cpus = f'{os.cpu_count()} CPUs'
    if 'hypervisor' in flags:
        vendor = _hypervisor()
        cpus = f'{os.cpu_count()} vCPUs' + (f' under {vendor}' if vendor else '')
    text = name + (f' ({where[0]})' if where else '') + f', {cpus}'
    return text + (f', {vector_units(flags)}' if flags else '')


def cpu_tag() -> str:
    """This CPU in a few letters, for the names of its records: its core generation where
    known, else its kind, with ``-amx`` where it has AMX tiles, e.g. ``zen3``, ``zen4``,
    ``ice-lake-sp``, ``xeon-amx``."""
    import re
    info = _cpuinfo()
    core = None
    if 'cpu family' in info and 'model' in info:
        core = _core(info.get('vendor_id', ''), int(info['cpu family']), int(info['model']))
    name = info.get('model name', '')
    kind = core or ('xeon' if 'Xeon' in name else 'epyc' if 'EPYC' in name else 'cpu')
    tag = re.sub(r'[^a-z0-9]+', '-', kind.lower()).strip('-').replace('zen-', 'zen')
    return tag + ('-amx' if 'amx_tile' in info.get('flags', '').split() else '')


def machine() -> dict:
    """What a measurement ran on, for its record: the CPU in words (name, family, vCPUs,
    vector units: :func:`cpu_description`), torch's threads, the versions and the commit the
    code ran at (``git describe --always --dirty``; None outside a checkout)."""
    import platform

    import mmcv
    import mmengine
    import mmseg
    try:
        commit = subprocess.run(['git', 'describe', '--always', '--dirty'], capture_output=True,
                                text=True, timeout=30, cwd=os.path.dirname(__file__),
                                ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(cpu=cpu_description(), cores=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, mmseg=mmseg.__version__,
                mmengine=mmengine.__version__, mmcv=mmcv.__version__,
                python=platform.python_version(), commit=commit)
