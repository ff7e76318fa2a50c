"""ONNX Runtime (``--level onnx``): the same checkpoint exported to ONNX unswapped, swapped
to MiTA at each setting (MiTA as standard ONNX operators, :mod:`mita_seg.ops.onnx`) and with
MiTA's node exported as ``out = v`` (attention removed, projections kept: the bound no
attention in the same graph beats), images per second of each file in ONNX Runtime on the
CPU, timed in turn, whole image at each size, the ratio to the unswapped file, MiTA's ratio
as a share of the bound's, and each file's peak memory (a file is skipped where the
``H x N x N`` weights of one of its dense attention layers exceed ``max_onnx_gib``: ViT-B
at 2048, the unswapped encoder's 12 GiB, and Segmenter's dense mask head's 12.2 GiB in the
swapped files too unless ``swap_head``)."""
import copy
import gc
import os
import tempfile

import torch

from mita_seg.analysis.timing import cpu_description, interleaved_medians, peak_memory_rise

from .common import model_config

__all__ = ['no_mixing_table', 'keep_arena', 'onnx_header', 'OnnxLevel', 'format_onnx_line']

_ROW = "{name:>16} {image:>10} {N:>6} {label:>18} | "


def no_mixing_table():
    """A translation of MiTA's node to ``out = v`` (as ``[B, N, H, d]``): the model with its
    attention mixing removed and its projections kept, the bound any attention in the same
    graph stays under (measurement only: not attention)."""
    from onnxscript import opset18 as op

    import mita_seg.ops  # noqa: F401  (registers torch.ops.mita_seg.mita_attention)

    def no_mixing(q, k, v, *args, **kwargs):
        return op.Transpose(v, perm=[0, 2, 1, 3])   # [B, N, H, d], as the op returns

    return {torch.ops.mita_seg.mita_attention.default: no_mixing}


def keep_arena(peaks_mib, memory_bytes):
    """Whether sessions alive together keep ORT's memory arena: ORT keeps up to about twice
    a run's peak between runs, so the arena is kept where the files' peaks (MiB, None:
    unknown) fit in a quarter of the memory (bytes, None: unknown) together; else every
    session gives its buffers back after each run. Returns ``(keep, total MiB)``."""
    total = sum(p or 0.0 for p in peaks_mib)
    return not memory_bytes or total * 2**20 <= memory_bytes / 4, total


def onnx_header(threads=None):
    """The lines above the table of :class:`OnnxLevel`."""
    import onnxruntime
    lines = [f'# ONNX Runtime {onnxruntime.__version__} CPU, {threads or "default"} intra-op '
             f'threads, on {cpu_description()}; random weights, batch '
             f'1, whole image; speed-up against softmax attention; "no mixing (bound)": MiTA\'s '
             'node exported as out = v (attention removed, projections kept); "of bound": the '
             'speed-up as a share of the bound\'s; peak: the rise of peak RSS in one run']
    header = (f"{'model':>16} {'image':>10} {'N':>6} {'attention':>18} | {'img/s':>7} "
              f"{'speed-up':>8} {'of bound':>8} | {'peak MiB':>8} | {'max |diff|':>10}")
    return lines + [header, '-' * len(header)]


class OnnxLevel:
    """``--level onnx``: one random-weight checkpoint per model exported unswapped, swapped
    to each of ``settings`` (:class:`~mita_seg.setting.MiTASetting`) and with its attention
    mixing removed (the bound), all timed in turn in ONNX Runtime (median over three
    interleaved rounds of at least ``min_run_time`` seconds each, a pause before each call
    so that the sessions' spinning threads do not overlap; ORT's memory arena kept where the
    files' peaks fit in a quarter of the memory together, :func:`keep_arena`), with each
    file's peak memory (one run of a session without ORT's memory arena, so what it
    allocates is given back and the peak is its own). A file is skipped where the
    ``[H, N, N]`` weights of one of its dense attention layers alone exceed
    ``max_onnx_gib`` (ORT materialises them): the softmax file's encoder, and Segmenter's
    mask head (N - 1 + 150 tokens) unless ``swap_head``.

    :meth:`rows` yields dicts, each with a ``kind``: ``row`` (a file timed), ``skip`` (a
    file skipped) or ``note`` (a line of text); :func:`format_onnx_line` prints them.
    ``progress`` (a callable taking a line) hears of each file exported and of the timing.
    """

    def __init__(self, models, sizes, settings, threads=None, swap_head=False,
                 min_run_time=1.0, max_onnx_gib=8.0, progress=None):
        self.models, self.sizes, self.settings = list(models), list(sizes), list(settings)
        self.threads, self.swap_head = threads or None, swap_head
        self.min_run_time, self.max_onnx_gib = min_run_time, max_onnx_gib
        self.progress = progress or (lambda line: None)

    def _variants(self, cfg):
        """``[(label, model, translation table)]``: softmax, each setting, the bound."""
        from mmseg.registry import MODELS as SEG_MODELS

        from mita_seg import swap_attention
        torch.manual_seed(0)
        model = SEG_MODELS.build(cfg.model).eval()
        variants = [('softmax', model, None)]
        for setting in self.settings:
            swapped = copy.deepcopy(model)
            swap_attention(swapped, setting, include_head=self.swap_head, verbose=False)
            variants.append((f'MiTA {setting.text}', swapped, None))
        variants.append(('no mixing (bound)', swapped, no_mixing_table()))
        return variants

    def _sized(self, variants, where):
        """The variants whose dense attention layers fit ``max_onnx_gib``, and a ``skip``
        row for each of the others."""
        from mita_seg.apis.onnx_export import SegLogits, dense_attention_weights
        size = where['size']
        kept, skipped, sized = [], [], {}
        for label, m, table in variants:
            # the dense attention layers a forward calls, sized on a copy on the meta
            # device (shapes only, nothing computed); the bound's model is the last
            # MiTA file's, sized once
            if id(m) not in sized:
                meta = copy.deepcopy(m).to('meta')
                run = SegLogits(meta, (size, size))
                with torch.no_grad():
                    sized[id(m)] = dense_attention_weights(
                        meta, lambda: run(torch.zeros(1, 3, size, size, device='meta')))
                del meta, run
            dense = sized[id(m)]
            # ORT holds a layer's scores and their softmax: the weights are half
            gib = dense[0][1] / 2 / 2**30 if dense else 0.0
            if gib <= self.max_onnx_gib:
                kept.append((label, m, table))
                continue
            hint = '' if label == 'softmax' or self.swap_head else ' (--swap-head: MiTA)'
            skipped.append(dict(where, kind='skip', label=label, layer=dense[0][0], hint=hint,
                                gib=gib, max_gib=self.max_onnx_gib))
        return kept, skipped

    def _export(self, variants, feed, tmp, where):
        """Each variant written to an ONNX file and run once without ORT's arena:
        ``(paths, peaks in MiB, max |diff| to the softmax file's output)``."""
        from mita_seg.apis.onnx_export import SegLogits, onnx_session, write_onnx
        name, size = where['name'], where['size']
        paths, peaks, base_out, diffs = [], [], None, []
        for i, (label, m, table) in enumerate(variants):
            path = os.path.join(tmp, f'{name}-{size}-{i}.onnx')
            write_onnx(SegLogits(m, (size, size)).eval(), (size, size), path, table=table)
            paths.append(path)
            # memory first, in a session that gives its buffers back after the run
            mem_sess = onnx_session(path, self.threads, arena=False)
            out, peak = peak_memory_rise(lambda sess=mem_sess: sess.run(None, feed)[0],
                                         torch.device('cpu'))
            del mem_sess
            peaks.append(peak)
            if label == 'softmax':
                base_out = out
            diffs.append(None if base_out is None else float(abs(base_out - out).max()))
            del out
            self.progress(f'# {name} {size}x{size}: {label} exported and run ({i + 1}/'
                          f'{len(variants)})')
        return paths, peaks, diffs

    def _time(self, paths, feed, arena, where):
        """Medians of each file's run, timed in turn (the files are removed once their
        sessions are open)."""
        from mita_seg.apis.onnx_export import onnx_session
        runs = []
        for path in paths:
            sess = onnx_session(path, self.threads, arena=arena)
            sess.run(None, feed)
            runs.append(lambda sess=sess: sess.run(None, feed))
            os.remove(path)
        self.progress(f"# {where['name']} {where['size']}x{where['size']}: timing "
                      f'{len(paths)} files x 3 rounds')
        # interleaved rounds: all see the same load of the host
        # ORT's default sessions, as a user runs one: their intra-op threads spin a while
        # after a run, and would take the cores from the next file's run: a pause first
        return interleaved_medians(runs, self.min_run_time, rounds=3, warmup=False,
                                   pause=0.2)

    def _one(self, cfg, where, tmp):
        """The rows of one model at one size."""
        from mita_seg.apis.model import physical_memory
        variants, skipped = self._sized(self._variants(cfg), where)
        yield from skipped
        if not variants:
            return
        img = torch.randn(1, 3, where['size'], where['size'])
        feed = {'img': img.numpy()}
        paths, peaks, diffs = self._export(variants, feed, tmp, where)
        labels = [v[0] for v in variants]
        del variants
        gc.collect()
        # The timed sessions are alive together (interleaved rounds): ORT's arena kept
        # where the files' peaks fit (keep_arena)
        memory = physical_memory()
        arena, total = keep_arena(peaks, memory)
        if not arena:
            yield dict(kind='note', text=(
                f"# {where['name']} {where['size']}x{where['size']}: timed without ORT's "
                f"memory arena (the files' peaks, {total / 1024:.1f} GiB together, exceed a "
                f'quarter of the {memory / 2**30:.0f} GiB of memory)'))
        medians = self._time(paths, feed, arena, where)
        base = medians[0] if labels[0] == 'softmax' else None
        bound = base / medians[-1] if base else None
        for label, t, peak, diff in zip(labels, medians, peaks, diffs):
            yield dict(where, kind='row', label=label, seconds=t, base=base, bound=bound,
                       peak=peak, diff=diff)
        gc.collect()

    def rows(self):
        """The rows of every model at every size (see the class)."""
        from mmengine.registry import init_default_scope

        import mita_seg.models  # noqa: F401
        init_default_scope('mmseg')
        tmp = tempfile.mkdtemp(prefix='mita-onnx-bench-')
        for name in self.models:
            cfg = model_config(name)
            cfg.model.test_cfg = dict(mode='whole')
            for size in self.sizes:
                where = dict(name=name, size=size, N=1 + (size // 16) ** 2)
                yield from self._one(cfg, where, tmp)
        os.rmdir(tmp)


def format_onnx_line(row):
    """A row of :meth:`OnnxLevel.rows` as printed."""
    if row['kind'] == 'note':
        return row['text']
    start = _ROW.format(image=f"{row['size']}x{row['size']}", **row)
    if row['kind'] == 'skip':
        return (start + f"skipped: the attention weights of {row['layer']}{row['hint']} alone "
                f"take {row['gib']:.3g} GiB > --max-onnx-gib {row['max_gib']:g}")
    t, base, bound, peak, diff = (row[k] for k in ('seconds', 'base', 'bound', 'peak', 'diff'))
    up = f'{base / t:7.2f}x' if base else f"{'n/a':>8}"
    share = (f'{100 * base / t / bound:7.0f}%' if bound and row['label'].startswith('MiTA')
             else f"{'':>8}")
    mem = f'{peak:8.0f}' if peak is not None else f"{'n/a':>8}"
    dtxt = f'{diff:10.3g}' if diff is not None else f"{'n/a':>10}"
    return start + f'{1 / t:7.3f} {up} {share} | {mem} | {dtxt}'
