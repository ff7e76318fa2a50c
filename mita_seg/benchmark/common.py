"""What the benchmark levels share: the models by name, token counts and grids, the settings
each level takes, seeded inputs, what one measurement runs, MiTA called at a setting, and
the fused CPU kernel's profile."""
import time

import torch

from mita_seg.analysis.timing import cpu_description, steady_allocator
from mita_seg.setting import KINDS, MiTASetting

__all__ = ['MODELS', 'TokenCountError', 'grid_side', 'DEFAULT_SETTING', 'KINDS_SETTINGS',
           'ONE_SETTING', 'level_settings', 'describe', 'random_inputs', 'timed_call', 'mita_call',
           'mac_ratio', 'profiled', 'format_kernel_profile', 'model_config']

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


# The levels that time one MiTA setting (``onnx``: a row per MiTA setting; ``kinds``: a
# column per setting of any kind), and the setting where none is given; ``kinds``: the
# taxonomy's kinds at about MiTA M = k = 49's attention cost at N = 1025 and less.
ONE_SETTING = ('op', 'threads', 'model', 'onnx-op', 'all')
DEFAULT_SETTING = '7:49'
KINDS_SETTINGS = ('7:49', 'agent:7', 'block:8:4', 'topk:49', 'window:7')


def level_settings(level, settings=None, tokens=None, onnx_sizes=(512, )):
    """The settings (:class:`~mita_seg.setting.MiTASetting`) the benchmark ``level`` runs:
    ``settings``, or its default where None; MiTA's kind but at ``kinds``, one at the
    levels of :data:`ONE_SETTING`, every pool at most the patch grid of the smallest input
    (of ``tokens``, default 1025; of ``onnx_sizes`` at ``onnx``, 16x16 patches).

    Raises:
        ValueError: a setting the level does not take, or a pool larger than the grid (the
            message names it and what to give instead).
    """
    texts = KINDS_SETTINGS if level == 'kinds' else (DEFAULT_SETTING, )
    settings = list(settings or [MiTASetting.parse(t) for t in texts])
    other = [s for s in settings if not s.is_mita]
    if other and level != 'kinds':
        raise ValueError(f'--settings {other[0].text}: --level {level} times MiTA: give MiTA '
                         f'settings (P:K, e.g. {DEFAULT_SETTING}); --level kinds times the '
                         'other kinds')
    if len(settings) > 1 and level in ONE_SETTING:
        raise ValueError(f'--settings {" ".join(s.text for s in settings)}: --level {level} '
                         f'times one setting: give one (e.g. --settings {DEFAULT_SETTING}); '
                         '--level onnx and kinds take several')
    pooled = [s for s in settings if 'pool_size' in KINDS[s.kind].keys]
    if not pooled or level == 'model':
        return settings
    big = max(pooled, key=lambda s: max(s.pool))
    pool = max(big.pool)
    if level == 'onnx':        # every model of MODELS has 16x16 patches
        side = min(onnx_sizes) // 16
        if pool > side:
            raise ValueError(f'--settings {big.text}: pool size {pool} is larger than the '
                             f'{side}x{side} patch grid of --onnx-sizes {min(onnx_sizes)}: '
                             f'give settings with P <= {side} or sizes of at least '
                             f'{16 * pool}')
        return settings
    tokens = tokens or [1025]        # the default token counts: 1025 (32x32) and more
    small = [n for n in tokens if grid_side(n) < pool]
    if small:
        raise ValueError(f'--settings {big.text}: pool size {pool} is larger than the grid of '
                         f'--tokens {small} ({grid_side(small[0])}x{grid_side(small[0])}): '
                         f'give a pool <= {min(grid_side(n) for n in tokens)} or more tokens')
    return settings


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


def mita_call(setting, q, k, v, side, **options):
    """MiTA at ``setting`` (a :class:`~mita_seg.setting.MiTASetting` of MiTA's kind, every
    key of it) on ``q, k, v`` ``[B, H, 1 + side^2, d]`` (cls and a square grid), as a
    swapped module calls it; ``options``: ``backend``, ``rel_pos_bias``."""
    from mita_seg.ops import mita_attention
    return mita_attention(q, k, v, (side, side), setting.pool_size, setting.topk,
                          setting.router_topk, 1, setting.with_shared_expert,
                          setting.shared_scale, **options)


def mac_ratio(setting, heads, num_tokens, head_dim):
    """Softmax attention's multiply-adds over ``setting``'s
    (:meth:`~mita_seg.setting.MiTASetting.attention_macs`) on ``1 + s*s`` tokens."""
    from mita_seg.ops import attention_flops
    side = grid_side(num_tokens)
    return attention_flops(1, heads, num_tokens, head_dim) / (
        heads * setting.attention_macs((side, side), num_tokens, head_dim))


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
