"""The model level (``--level model``): images per second and peak memory of mmseg
segmenters (``mmseg::`` configs of :data:`~.common.MODELS`, random weights), each image a
row (``slide``: a 512x683 image under the config's slide inference over 512 crops; ``S`` or
``HxW``: the whole image at once), four ways: ``mmseg`` as released (mmcv's attention calls
``nn.MultiheadAttention`` with ``need_weights=True``, which materialises the N x N weights),
``dense``, the fast dense model a user would run instead (the same attention on PyTorch's
fused SDPA path, ``need_weights=False``, and :class:`~mita_seg.models.SlimEncoderDecoder`'s
lighter slide inference: the same results), ``MiTA`` (the fast dense model swapped to MiTA,
the encoder only as the paper unless ``swap_head``; the header says which layers) and
``bound`` (the same layers with their attention mixing removed, ``out = v`` with the q, k,
v and output projections kept, :mod:`mita_seg.analysis.bound`: what no attention there can
beat). Every speed-up names its baseline (``MiTA/dense``: MiTA's img/s over the fast dense
model's, the headline); ``MiTA %bnd`` is MiTA/dense over bound/dense. The variants are
timed in turn, a call of each per round (a call takes seconds: timed one after the other,
their ratios carried the host's drift). A dtype other than float32: each under
``torch.autocast`` (the float32 model, as CPU serving in bf16 runs it). With a merge ratio,
token merging (ToMe, ``mita_seg.merge_tokens``) on the fast dense model is a fifth column.
With ``compile``, the fast dense model and MiTA compiled with ``torch.compile`` (inductor;
the backbone's and the decode head's forward, a graph per input shape, compiled in the
warm-up calls) are two more columns, ``MiTA+c/dense+c`` their ratio. With ``profile``,
MiTA's time is split into the kernel and the rest of its attention (MiTA's time less the
bound's)."""
import torch

from mita_seg.analysis.timing import interleaved_medians, peak_memory_rise
from mita_seg.setting import DEFAULT_SETTING

from .common import describe, model_config, profiled

__all__ = ['MODEL_VARIANTS', 'SLIDE_IMAGE', 'ModelLevel']

# The model level's columns: (label, what it is). Every one but mmseg runs the lighter
# slide inference and the fused SDPA path in its dense attention layers
# (SlimEncoderDecoder with dense_attn='fast': mmseg's results to float32 rounding).
MODEL_VARIANTS = (
    ('mmseg', 'mmseg as released (EncoderDecoder; mmcv MultiheadAttention calls '
              'nn.MultiheadAttention with need_weights=True: the N x N weights materialised)'),
    ('dense', 'the fast dense model: SlimEncoderDecoder(dense_attn=\'fast\'), the same '
              'attention on PyTorch\'s fused SDPA path (need_weights=False, '
              'mita_seg.models.set_dense_attn) and the lighter slide inference'),
    ('MiTA', 'the fast dense model swapped to MiTA {setting}; what runs: {swapped}'),
    ('bound', 'the fast dense model with the attention mixing of those layers removed (out '
              '= v; q, k, v and output projections kept): what no attention there can beat'),
)
# image label -> (h, w, test mode): slide over the config's 512 crops of an ADE20K-like
# image, or the whole image
SLIDE_IMAGE = (512, 683)


def _wide(text, w):
    """A column as wide as its name, ``w`` at least."""
    return max(w, len(text))


class ModelLevel:
    """The model level on ``models`` (names of :data:`~.common.MODELS`) and ``images``
    (``'slide'`` or ``'HxW'``), each in ``dtypes``: :meth:`header` the lines above the
    table (the models are built first), :meth:`rows` the measured rows (dicts),
    :meth:`format_row` a row as printed.

    Args:
        setting (MiTASetting, optional): the MiTA setting of the ``MiTA`` and ``bound``
            columns. Default: None, MiTA's defaults (M = k = 49).
        memory (bool): measure each variant's peak memory (two calls of each before the
            timing). Default: True.
        rounds (int): rounds at least, a call of each variant per round. Default: 3.
        max_mmcv_gib (float): the mmseg column is n/a where its N x N weights exceed this
            many GiB. Default: 8.
    """

    def __init__(self, models, images, dtypes=('float32', ), device='cpu', setting=None,
                 swap_head=False, merge_ratio=None, compile=False, rounds=3, memory=True,
                 min_run_time=1.0, max_mmcv_gib=8.0, profile=False):
        self.models, self.images, self.dtypes = list(models), list(images), list(dtypes)
        self.device = torch.device(device)
        self.setting = DEFAULT_SETTING if setting is None else setting
        self.swap_head = swap_head
        self.merge_ratio, self.compile, self.rounds = merge_ratio, compile, rounds
        self.memory, self.min_run_time, self.max_mmcv_gib = memory, min_run_time, max_mmcv_gib
        self.profile = profile
        tome = merge_ratio is not None
        self.names = ([v[0] for v in MODEL_VARIANTS] + (['ToMe'] if tome else [])
                      + (['dense+c', 'MiTA+c'] if compile else []))
        self.speedups = [('dense/mmseg', 'mmseg', 'dense'), ('MiTA/dense', 'dense', 'MiTA'),
                         ('bound/dense', 'dense', 'bound'), ('MiTA/mmseg', 'mmseg', 'MiTA')] + (
            [('ToMe/dense', 'dense', 'ToMe')] if tome else []) + (
            [('dense+c/dense', 'dense', 'dense+c'), ('MiTA+c/dense+c', 'dense+c', 'MiTA+c')]
            if compile else [])
        self.built = None

    def _variant(self, cfg, state, variant):
        """The fast dense model of ``cfg`` with the weights ``state``, made ``variant``."""
        from mmseg.registry import MODELS as SEG_MODELS

        from mita_seg import merge_tokens, swap_attention
        from mita_seg.analysis.bound import remove_attention_mixing
        m = SEG_MODELS.build(dict(cfg.model, type='SlimEncoderDecoder',
                                  dense_attn='fast')).eval().to(self.device)
        m.load_state_dict(state)            # the same weights in each
        if variant in ('MiTA', 'bound', 'MiTA+c'):
            swap_attention(m, self.setting, include_head=self.swap_head, verbose=False)
        if variant == 'bound':
            remove_attention_mixing(m)
        if variant == 'ToMe':
            merge_tokens(m, self.merge_ratio, verbose=False)
        if variant.endswith('+c'):        # a graph per input shape, no dynamic shapes
            for part in (m.backbone, m.decode_head):
                part.forward = torch.compile(part.forward, dynamic=False)
        return m

    def _build(self, name):
        """``({variant: model}, the swap plan in words, test_cfg, patch size)``."""
        from mmseg.registry import MODELS as SEG_MODELS

        from mita_seg.models import current_plan, dense_attn_of
        cfg = model_config(name)
        cfg.model.pop('data_preprocessor', None)
        torch.manual_seed(0)
        base = SEG_MODELS.build(cfg.model).eval().to(self.device)
        state = base.state_dict()
        models = {'mmseg': base}
        for variant in self.names[1:]:
            models[variant] = self._variant(cfg, state, variant)
        plan = current_plan(models['MiTA']).describe()
        paths = {v: dense_attn_of(m) for v, m in models.items()}  # what each runs
        if paths['mmseg'] != 'mmseg' or paths['dense'] != 'fast':
            raise RuntimeError(f'{name}: the dense attention paths are {paths}; expected '
                               "mmseg's own for mmseg and the fast one for dense")
        return models, plan, cfg.model.test_cfg, cfg.model.backbone.get('patch_size', 16)

    def build(self):
        """Build every model's variants (random weights, the same in each); once."""
        if self.built is None:
            from mmengine.registry import init_default_scope

            import mita_seg.models  # noqa: F401
            init_default_scope('mmseg')
            self.built = {name: self._build(name) for name in self.models}
        return self.built

    def _what(self, label, what):
        if label != 'MiTA':
            return what
        return what.format(swapped='; '.join(
            f'{name}: {plan}' for name, (_, plan, *_) in self.build().items()),
            setting=f'{self.setting.text} ({self.setting.label}), '
            + ('the mask head too (--swap-head)' if self.swap_head else
               'the encoder only as the paper (--swap-head: the mask head too)'))

    def header(self):
        """The lines above the table: what each column is, and the header (the models are
        built first: the MiTA column names the layers swapped)."""
        dev = self.device
        self.build()
        lines = [f'# model level: random weights, batch 1, eval, no_grad; {dev.type} '
                 f'({describe(dev)}); torch {torch.__version__}; bfloat16 = the float32 '
                 'model under torch.autocast']
        lines += [f'# {label} = {self._what(label, what)}' for label, what in MODEL_VARIANTS]
        if self.merge_ratio is not None:
            lines.append(f'# ToMe = the fast dense model with tokens merged at ratio '
                         f'{self.merge_ratio:g} before each attention and MLP of the ViT '
                         'layers (mita_seg.merge_tokens)')
        if self.compile:
            lines.append('# dense+c, MiTA+c = dense and MiTA with the forward of the backbone '
                         'and the decode head under torch.compile (inductor, dynamic=False; '
                         'compiled in the warm-up calls, not timed)')
        lines.append(
            f'# img/s of each, timed in turn (a call of each per round, the median of at least '
            f'{self.rounds} rounds); a speed-up A/B = img/s of A over B in this run; MiTA %bnd '
            '= MiTA/dense over bound/dense; N = tokens per forward; memory = peak rise (MiB, '
            f"RSS{'' if self.memory else ': not measured, --no-memory'}); n/a: mmseg's N x N "
            'weights over --max-mmcv-gib')
        names, speedups = self.names, self.speedups
        header = (f"{'model':>16} {'image':>9} {'mode':>5} {'N':>6} {'dtype':>8} | " +
                  ' '.join(f'{n:>8}' for n in names) + ' | ' +
                  ' '.join(f'{s[0]:>{_wide(s[0], 11)}}' for s in speedups) +
                  f" {'MiTA %bnd':>9} | " +
                  ' '.join(f'{n + " MiB":>{_wide(n + " MiB", 9)}}' for n in names))
        return lines + [header, '-' * len(header)]

    def _row_calls(self, name, image, dtype):
        """``(mode, N, {variant: one predict call})`` of a row (None: mmseg's N x N
        weights over ``max_mmcv_gib``)."""
        from mmengine.config import ConfigDict
        from mmseg.structures import SegDataSample
        models, _, test_cfg, patch = self.build()[name]
        dev = self.device
        if image == 'slide':
            (h, w), cfg = SLIDE_IMAGE, test_cfg
            crop = test_cfg.get('crop_size', (512, 512))
            n = 1 + -(-crop[0] // patch) * -(-crop[1] // patch)
        else:
            h, w = (int(t) for t in image.split('x'))
            cfg = ConfigDict(mode='whole')
            n = 1 + -(-h // patch) * -(-w // patch)
        g = torch.Generator().manual_seed(0)
        img = torch.randn(1, 3, h, w, generator=g).to(dev)
        meta = [SegDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w),
                                            pad_shape=(h, w)))]
        dt = getattr(torch, dtype)
        heads = models['mmseg'].backbone.layers[0].attn.num_heads
        calls = {}
        for variant, m in models.items():
            if variant == 'mmseg' and 2 * heads * n * n * 4 > self.max_mmcv_gib * 2**30:
                calls[variant] = None
                continue

            def run(m=m):
                m.test_cfg = cfg
                with torch.autocast(dev.type, dtype=dt, enabled=dt != torch.float32):
                    return m.predict(img, meta)
            calls[variant] = run
        return cfg.get('mode', 'whole'), n, calls

    def rows(self):
        """A row (dict) per model, image and dtype: ``name``, ``image``, ``size`` (the
        image's ``[h, w]``: ``slide`` is :data:`SLIDE_IMAGE`), ``mode``, ``N``, ``dtype``,
        ``times`` (seconds per image by variant, the variants run), ``memory``
        (peak MiB by variant, None where not measured), ``kernel`` (``profile`` on CPU:
        seconds per image in the fused kernel of MiTA's call; else None). Memory first,
        every row, before any timing (see :func:`.op.op_rows`)."""
        rows = [(name, image, dtype) for name in self.models for image in self.images
                for dtype in self.dtypes]
        with torch.no_grad():
            peaks = {}
            for row in rows:
                calls = self._row_calls(*row)[2]
                peaks[row] = {v: peak_memory_rise(c, self.device)[1] if c and self.memory
                              else None for v, c in calls.items()}
            for row in rows:
                mode, n, calls = self._row_calls(*row)
                live = [v for v in self.names if calls[v]]
                times = dict(zip(live, interleaved_medians(
                    [calls[v] for v in live], self.min_run_time, rounds=self.rounds,
                    device=self.device)))
                kernel = None
                if self.profile and self.device.type == 'cpu':  # the kernel's s per image
                    kernel = sum(profiled(calls['MiTA'], reps=2)[1].values())
                size = SLIDE_IMAGE if row[1] == 'slide' else row[1].split('x')
                yield dict(name=row[0], image=row[1], size=[int(t) for t in size], mode=mode,
                           N=n, dtype=row[2], times=times, memory=peaks[row], kernel=kernel)

    def format_row(self, row):
        """A row of :meth:`rows` as printed (and the kernel's share on a line below)."""
        times, peaks, names = row['times'], row['memory'], self.names
        speed = lambda v: f'{1 / times[v]:8.3g}' if v in times else f"{'n/a':>8}"  # noqa

        def ratio(a, b, w):
            return (f'{times[a] / times[b]:{w - 1}.2f}x' if a in times and b in times
                    else f"{'n/a':>{w}}")

        def mem(v, w):
            return f'{peaks[v]:{w}.0f}' if peaks[v] is not None else f"{'n/a':>{w}}"

        line = (f"{row['name']:>16} {row['image']:>9} {row['mode']:>5} {row['N']:>6} "
                f"{row['dtype']:>8} | " + ' '.join(speed(v) for v in names) + ' | ' +
                ' '.join(ratio(a, b, _wide(s, 11)) for s, a, b in self.speedups) +
                f" {100 * times['bound'] / times['MiTA']:8.0f}% | " +
                ' '.join(mem(v, _wide(v + ' MiB', 9)) for v in names))
        if row['kernel'] is not None:
            mita, bound, kernel = times['MiTA'], times['bound'], row['kernel']
            line += (f'\n#   MiTA {mita:.3f} s per image, bound {bound:.3f} s: MiTA\'s '
                     f'attention {mita - bound:.3f} s, of it {kernel:.3f} s in the kernel and '
                     f'{mita - bound - kernel:.3f} s outside it (projections excluded); with '
                     f"the kernel free MiTA/dense would be {times['dense'] / (mita - kernel):.2f}"
                     'x')
        return line
