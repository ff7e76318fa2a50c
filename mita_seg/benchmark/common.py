"""What the benchmark levels share: the models by name, token counts and grids, seeded
inputs, what one measurement runs, and the fused CPU kernel's profile."""
import time

import torch

from mita_seg.analysis.timing import cpu_description, steady_allocator

__all__ = ['MODELS', 'TokenCountError', 'grid_side', 'describe', 'random_inputs',
           'timed_call', 'profiled', 'format_kernel_profile', 'model_config']

# name -> config (every one with 16x16 patches)
MODELS = {
    'segmenter-vit-t': 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py',
    'segmenter-vit-s': 'mmseg::segmenter/segmenter_vit-s_mask_8xb1-160k_ade20k-512x512.py',
    'segmenter-vit-b': 'mmseg::segmenter/segmenter_vit-b_mask_8xb1-160k_ade20k-512x512.py',
    'upernet-vit-b': 'mmseg::vit/vit_vit-b16_mln_upernet_8xb2-160k_ade20k-512x512.py',
}


class TokenCountError(ValueError):
    """A token count that is not ``1 + s*s`` (a cls token and an ``s x s`` grid)."""


def grid_side(num_tokens: int) -> int:
    """``s`` of a token count ``N = 1 + s * s`` (a cls token and an ``s x s`` grid).

    Raises:
        TokenCountError: ``num_tokens`` is not ``1 + s * s``; the message names the two
            nearest counts that are.
    """
    side = int(round((num_tokens - 1) ** 0.5))
    if side * side + 1 != num_tokens:
        raise TokenCountError(f'give 1 + s*s tokens (a cls token and an s x s grid), e.g. '
                              f'{1 + side * side} or {2 + 2 * side + side * side}')
    return side


def describe(device: torch.device) -> str:
    """The device, in words: the GPU's name, or the CPU (:func:`cpu_description`) and
    torch's thread count."""
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    return f'{cpu_description()}; {torch.get_num_threads()} threads'


def random_inputs(H, N, d, device, dtype, requires_grad):
    """Seeded ``q, k, v`` ``[1, H, N, d]``, an output gradient, and the generator (for
    further seeded inputs of the same call)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, N, d, generator=g).to(device, dtype).requires_grad_(
        requires_grad) for _ in range(3))
    grad = torch.randn(1, H, N, d, generator=g).to(device, dtype)
    return q, k, v, grad, g


def timed_call(f, pass_, inputs, grad):
    """What one measurement runs: ``f()`` under no_grad, or ``f()`` and the gradients of
    ``inputs``."""
    if pass_ == 'fwd+bwd':
        return lambda: torch.autograd.grad(f(), inputs, grad)

    def run():
        with torch.no_grad():
            return f()
    return run


def profiled(run, reps=5):
    """Seconds per call of ``run`` and the fused CPU kernel's phases within it (seconds per
    call, each phase's wall time), with the allocator of the timings (steady_allocator)."""
    from mita_seg.ops.fused_cpu import profile
    with steady_allocator():
        run()  # buffers of the steady state
        profile(True)
        try:
            t0 = time.perf_counter()
            for _ in range(reps):
                run()
            total = (time.perf_counter() - t0) / reps
        finally:
            phases = profile(False)
    return total, {k: v / reps for k, v in phases.items() if v > 0}


def format_kernel_profile(total, phases):
    """One line: the fused CPU kernel's phases of :func:`profiled` (ms per call, summed
    over threads' wall time of each phase; ``other`` is the rest: Python, dtype
    conversions, allocation)."""
    parts = [f'{k} {v * 1e3:.2f}' for k, v in phases.items()]
    other = total - sum(phases.values())
    return f"#   MiTA {total * 1e3:.2f} ms: {', '.join(parts)}, other {other * 1e3:.2f}"


def model_config(name):
    """The config of the model ``name`` of :data:`MODELS`, for random weights (no
    pretrained checkpoint, no backbone ``init_cfg``)."""
    from mmengine.hub import get_config
    cfg = get_config(MODELS[name])
    cfg.model.pop('pretrained', None)
    cfg.model.backbone.pop('init_cfg', None)
    return cfg
