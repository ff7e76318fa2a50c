"""Configs for the tools: a file or ``mmseg::<dir>/<name>.py``, ``--cfg-options``, work_dir,
the segmentor that gives mmseg's results with lighter inference, and the dense attention
path (``dense_attn``)."""
import os
import os.path as osp
from typing import Optional, Union

import torch.nn as nn
from mmengine.config import Config

from mita_seg.models.fast_attention import check_dense_attn, set_dense_attn
from mita_seg.utils.cfg_options import add_custom_imports, merge_cfg_options
from mita_seg.utils.errors import InputError


def config_name(config: Union[str, os.PathLike]) -> str:
    """``'configs/a.py'`` and ``'mmseg::vit/a.py'`` -> ``'a'``."""
    return osp.splitext(osp.basename(os.fspath(config).split('::')[-1]))[0]


def load_config(config: Union[str, os.PathLike],
                cfg_options: Optional[dict] = None,
                work_dir: Optional[str] = None) -> Config:
    """An mmengine ``Config`` from a file or from an installed package, ready for a tool.

    Args:
        config (str | PathLike): a config file, or a config shipped with mmsegmentation
            (``'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'``).
        cfg_options (dict, optional): ``--cfg-options``, merged into the config and
            remembered (:func:`~mita_seg.utils.cfg_options.merge_cfg_options`): a model,
            dataloader... that cannot be built with one of them says which (a
            ``CfgOptionsError``, an :class:`InputError`).
        work_dir (str, optional): the run's directory. Default: the config's ``work_dir``,
            else ``./work_dirs/<config name>`` (mmseg's rule).

    Returns:
        Config: the config, with ``work_dir`` set.

    Raises:
        FileNotFoundError: the config file does not exist (IsADirectoryError: it is a
            folder).
        InputError: the file is no config (it does not parse, or defines no ``model``).
        TypeError: ``config`` is neither a path nor a name (a ``Config`` is already loaded).
    """
    config = os.fspath(config)
    if osp.isdir(config):
        raise IsADirectoryError(f'config {config!r} is a directory: give a config file '
                                '(.py/.json/.yaml) or \'mmseg::<dir>/<config>.py\'')
    if osp.isfile(config):
        try:
            cfg = Config.fromfile(config)
        except Exception as e:  # noqa: BLE001  (a file that is no config, re-raised)
            raise InputError(f'config {config} cannot be read as an mmengine config '
                             f'({type(e).__name__}: {e}): give a .py/.json/.yaml config '
                             'file') from e
    elif '::' in config:
        from mmengine.hub import get_config
        try:
            cfg = get_config(config)
        except FileNotFoundError as e:
            raise FileNotFoundError(f'config {config!r} does not exist: {e}') from e
        except Exception as e:  # noqa: BLE001  (another package, a name that is no config)
            raise InputError(f'config {config!r} cannot be loaded ({type(e).__name__}: {e}):'
                             " give 'mmseg::<dir>/<config>.py', a config of the installed "
                             'mmsegmentation') from e
    else:
        raise FileNotFoundError(f'config {config!r} does not exist: give a config file or '
                                "'mmseg::<dir>/<config>.py' (a config of the mmsegmentation "
                                'package)')
    if not isinstance(cfg.get('model'), dict):
        raise InputError(f'config {config} defines no model (no `model = dict(...)`): give '
                         'an mmseg config, e.g. one of configs/')
    merge_cfg_options(cfg, cfg_options)
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', config_name(config))
    return cfg


# segmentor type -> the one with the same results and lighter slide inference
SLIM_SEGMENTORS = {'EncoderDecoder': 'SlimEncoderDecoder',
                   'mmseg.EncoderDecoder': 'SlimEncoderDecoder'}
SLIM_TYPES = ('SlimEncoderDecoder', 'mmseg.SlimEncoderDecoder')


def dense_attn_setting(cfg: Config) -> str:
    """The dense attention path ``cfg`` asks for: its top-level ``dense_attn``
    (``--dense-attn``), else that of its ``SlimEncoderDecoder`` (a TTA model's too), else
    ``'fast'``.

    Raises:
        InputError: neither ``'fast'`` nor ``'mmseg'``.
    """
    mode = cfg.get('dense_attn', None)
    model = cfg.get('model')
    while mode is None and isinstance(model, dict):
        mode = model.get('dense_attn', None)
        model = model.get('module')     # SegTTAModel wraps the segmentor
    mode = 'fast' if mode is None else mode
    try:
        return check_dense_attn(mode)
    except ValueError as e:
        raise InputError(str(e)) from None


def use_slim_inference(cfg: Config) -> Config:
    """Put an ``EncoderDecoder`` model of ``cfg`` on
    :class:`~mita_seg.models.SlimEncoderDecoder` (the same seg logits and class maps, bit
    for bit, from lighter slide inference and post-processing), in place; a TTA model's
    ``module`` too. A config with ``slim_inference = False`` (``--cfg-options
    slim_inference=False``) gets mmseg's ``EncoderDecoder`` instead, also where it named
    ``SlimEncoderDecoder`` itself. Other segmentors are left as they are; a switched
    config imports ``mita_seg.models`` (``custom_imports``), so its dump builds anywhere.

    It also settles the dense attention path (:func:`dense_attn_setting`:
    ``--dense-attn``, ``'fast'`` by default; :func:`~mita_seg.models.set_dense_attn`):
    written to the config's top level ``dense_attn`` (what :func:`use_dense_attn` applies
    to a model of any segmentor) and to a ``SlimEncoderDecoder``'s arguments (so a dumped
    config builds the same).

    Returns:
        Config: ``cfg``.

    Raises:
        InputError: ``dense_attn`` is neither ``'fast'`` nor ``'mmseg'``.
    """
    slim = cfg.get('slim_inference', True)
    dense_attn = dense_attn_setting(cfg)
    cfg.dense_attn = dense_attn
    model = cfg.get('model')
    while isinstance(model, dict):
        kind = model.get('type')
        if slim and kind in SLIM_SEGMENTORS:
            model['type'] = SLIM_SEGMENTORS[kind]
            add_custom_imports(cfg, 'mita_seg.models')   # a dumped config builds it too
        elif not slim and kind in SLIM_TYPES:
            model['type'] = 'EncoderDecoder'
        if model.get('type') in SLIM_TYPES:
            model['dense_attn'] = dense_attn
        else:
            model.pop('dense_attn', None)   # mmseg's EncoderDecoder has no such argument
        model = model.get('module')     # SegTTAModel wraps the segmentor
    return cfg


def use_dense_attn(model: nn.Module, cfg: Config) -> int:
    """Put ``model``, built from ``cfg``, on the dense attention path ``cfg`` asks for
    (:func:`dense_attn_setting`), whatever its segmentor (mmseg's ``EncoderDecoder`` has
    no such argument), in place.

    Returns:
        int: the number of mmcv ``MultiheadAttention`` modules on that path.
    """
    return set_dense_attn(model, dense_attn_setting(cfg))


def keep_predictions(cfg: Config, out: str) -> int:
    """Have ``cfg``'s test evaluator write its predictions under ``out`` (``tools/test.py
    --out``, mmseg's rule: ``output_dir`` and ``keep_results``), in place. The evaluator may
    be one metric or a list of them (the long-range configs': an IoU metric and the evidence
    accuracy); each metric whose class takes ``output_dir`` (mmseg's ``IoUMetric`` and its
    subclasses) gets it.

    Returns:
        int: the number of metrics that write predictions.

    Raises:
        InputError: no metric of the test evaluator writes predictions.
    """
    import inspect

    from mmseg.registry import METRICS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    evaluator = cfg.get('test_evaluator')
    metrics = evaluator if isinstance(evaluator, (list, tuple)) else [evaluator]
    kept = 0
    for metric in metrics:
        cls = METRICS.get(metric.get('type')) if isinstance(metric, dict) else None
        if cls is not None and 'output_dir' in inspect.signature(cls).parameters:
            metric['output_dir'] = out
            metric['keep_results'] = True
            kept += 1
    if not kept:
        types = [m.get('type') if isinstance(m, dict) else m for m in metrics]
        raise InputError(f'--out: no metric of the test evaluator ({types}) writes predictions'
                         " (mmseg's IoUMetric does, through output_dir): add one or leave out "
                         '--out')
    return kept
