"""The one ``--swap-attn`` / ``--mita-cfg`` / ``--mita-plan`` / ``--dense-attn`` of every
tool, checked while parsing, and the argparse types of a setting.

``--swap-attn 7:49`` (or ``agent:7``, ``block:8:4``, ``topk:49``, ``window:7``: any spelling
of :meth:`~mita_seg.setting.MiTASetting.parse`); ``--mita-cfg pool_size=7 topk=49
router_topk=1 with_shared_expert=True shared_scale=0.02 layers=[0,1] include_head=True``:
single keys (:func:`~mita_seg.apis.check_mita_cfg`), over a ``--swap-attn`` setting or over
the defaults (``--swap-attn mita``, implied by ``--mita-cfg``). An unknown name or a bad
value ends the tool at once with exit status 2 and a message naming the setting and what it
accepts, before anything is built or loaded.

``--mita-plan PLAN.json`` (instead of ``--mita-cfg``): one setting per attention layer, dense
allowed (:class:`~mita_seg.models.SwapPlan`, written by ``tools/calibrate_swap.py``); the file
is read and checked at argument parsing too (exit status 2 naming the layer or setting), its
fit to the model when the model is built (exit status 1). :func:`swap_settings` returns it as
``{'plan': SwapPlan}``, which every path that takes ``--mita-cfg`` passes on to
:func:`~mita_seg.swap_attention`.
"""
import argparse
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from mita_seg.apis.mita_cfg import check_mita_cfg, mita_cfg_rules
from mita_seg.setting import (MITA, MITA_DEFAULTS, MITA_KEYS, SETTING_KEYS, MiTASetting,
                              MiTASettingError)
from .core import DeferredHelp, KeyValueAction

# mita_seg.models (the plans) is imported where it is used: a tool builds its parser, and
# refuses a bad path or number, without importing the mm stack.

__all__ = ['setting_arg', 'setting_or_dense_arg', 'swap_attn_arg', 'read_plan_arg',
           'MiTACfgAction', 'DenseAttnAction', 'add_dense_attn_arg', 'add_mita_args',
           'swap_settings']


def setting_arg(text: str) -> MiTASetting:
    """An argparse ``type``: :meth:`MiTASetting.parse` (a bad one is a usage error)."""
    try:
        return MiTASetting.parse(text)
    except MiTASettingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def setting_or_dense_arg(text: str) -> Optional[MiTASetting]:
    """An argparse ``type``: :meth:`MiTASetting.parse_or_dense` (``dense``: None)."""
    try:
        return MiTASetting.parse_or_dense(text)
    except MiTASettingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class MiTACfgAction(KeyValueAction):
    """mmengine's ``DictAction`` (``key=value`` pairs, values as Python literals) that
    checks names and values; a bad one is a usage error (exit status 2)."""

    exclude: Sequence[str] = ()
    example = 'topk=49'

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        try:
            check_mita_cfg(getattr(namespace, self.dest), self.exclude)
        except ValueError as e:
            parser.error(f'{option_string}: {e}')


def swap_attn_arg(text: str):
    """``--swap-attn``'s ``type``: ``'none'``, ``'mita'`` or a setting
    (:meth:`~mita_seg.setting.MiTASetting.parse`: a bad one is a usage error)."""
    if text in ('none', MITA):
        return text
    try:
        return MiTASetting.parse(text)
    except MiTASettingError as e:
        raise argparse.ArgumentTypeError(f'{e}; or none, or mita (with --mita-cfg)') from None


def always_swap_attn_arg(text: str):
    """``--swap-attn``'s ``type`` in a tool that always swaps: ``'mita'`` or a setting."""
    if text == 'none':
        raise argparse.ArgumentTypeError('this tool always swaps: give a setting (e.g. 7:49, '
                                         'agent:7) or mita (with --mita-cfg)')
    return swap_attn_arg(text)


def read_plan_arg(path: str) -> 'SwapPlan':  # noqa: F821
    """``--mita-plan``'s ``type``: the plan file, read and checked (a bad one is a usage
    error naming the file and the layer or setting)."""
    from mita_seg.models import PlanError, SwapPlan
    try:
        return SwapPlan.load(path)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class DenseAttnAction(argparse.Action):
    """``--dense-attn MODE``: ``--cfg-options dense_attn=MODE`` (merged into the tool's
    ``cfg_options``, which every tool passes to its config), also kept as ``dense_attn``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        options = dict(getattr(namespace, 'cfg_options', None) or {})
        options['dense_attn'] = values
        namespace.cfg_options = options


def add_dense_attn_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--dense-attn {fast,mmseg}`` to a tool with ``--cfg-options`` (the config's
    ``dense_attn``, :func:`~mita_seg.apis.use_slim_inference`)."""
    parser.add_argument(
        # mita_seg.models.DENSE_ATTN_MODES, spelt out: the parser is built without the stack
        # (tests/test_bad_input.py checks that they agree)
        '--dense-attn', choices=('fast', 'mmseg'), default=None, action=DenseAttnAction,
        help='path of the dense (standard) global attention: "fast" (default: PyTorch\'s '
        'fused scaled_dot_product_attention, mmseg\'s results to float32 rounding) or '
        '"mmseg" (mmseg\'s own, which materialises the N x N weights); same as '
        '--cfg-options dense_attn=...')


def add_mita_args(parser: argparse.ArgumentParser, swap_flag: bool = True,
                  exclude: Sequence[str] = ()) -> None:
    """Add ``--swap-attn SETTING``, ``--mita-cfg`` and ``--mita-plan`` to a tool, and
    ``--dense-attn`` (:func:`add_dense_attn_arg`).

    Args:
        parser (ArgumentParser): the tool's parser.
        swap_flag (bool): the tool swaps only on request (``--swap-attn SETTING`` or
            ``mita``, implied by ``--mita-cfg``; ``none`` for no swap); False: it always
            swaps (``--swap-attn`` defaults to ``mita``, ``none`` is refused). Default: True.
        exclude (Sequence[str]): settings the tool sets by other means (refused here).
    """
    def mita_cfg_help() -> str:
        rules = mita_cfg_rules(exclude)
        defaults = ' '.join(f'{k}={MITA_DEFAULTS[k]}' for k in MITA_KEYS if k in rules)
        return (f'MiTA settings: {", ".join(rules)}. Defaults for a model swapped now: '
                f'{defaults}; a model already on MiTA keeps its values for the settings not '
                'given.')

    parser.add_argument(
        '--swap-attn', type=swap_attn_arg if swap_flag else always_swap_attn_arg,
        default=None if swap_flag else 'mita', metavar='SETTING',
        help='put the global attention of the model on this setting before running: '
        '7:49 (MiTA, pool 7x7, top-k 49; 4x6:16, 7:49:route), agent:7 (compression '
        'only), block:8:4 (block routing), topk:49 (per-query top-k), window:7 (a local '
        'window); "mita": MiTA with --mita-cfg over the defaults (or reconfigure a '
        'model already on MiTA)' + (', implied by --mita-cfg; "none": no swap' if swap_flag
                                    else ' (default)'))
    action = type('MiTACfg', (MiTACfgAction, ), dict(exclude=tuple(exclude)))
    parser.add_argument(
        '--mita-cfg', nargs='+', action=action, default=None, metavar='KEY=VALUE',
        help=DeferredHelp(mita_cfg_help))
    parser.add_argument(
        '--mita-plan', type=read_plan_arg, default=None, metavar='PLAN.json',
        help='per-layer MiTA settings (dense allowed) from a swap plan, e.g. written by '
        'tools/calibrate_swap.py; instead of --mita-cfg')
    add_dense_attn_arg(parser)


def swap_settings(parser: argparse.ArgumentParser,
                  args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """The swap a tool's arguments ask for: None (no swap), the ``--mita-cfg`` dict (with
    ``setting``, the :class:`~mita_seg.setting.MiTASetting` of ``--swap-attn 7:49`` and
    the like, ``--mita-cfg``'s setting keys over it), or ``{'plan': SwapPlan}`` for
    ``--mita-plan`` (arguments of :func:`~mita_seg.swap_attention`).

    Raises:
        SystemExit: ``--swap-attn none`` with ``--mita-cfg`` or ``--mita-plan``, or both of
            these (a usage error, status 2).
    """
    swap = getattr(args, 'swap_attn', 'mita')
    plan = getattr(args, 'mita_plan', None)
    if plan is not None:
        if args.mita_cfg:
            parser.error('--mita-plan sets every layer: give --mita-plan or --mita-cfg, '
                         'not both')
        if swap == 'none':
            parser.error('--mita-plan needs --swap-attn mita (not none)')
        if isinstance(swap, MiTASetting):
            parser.error(f'--mita-plan sets every layer: give --mita-plan or --swap-attn '
                         f'{swap.text}, not both')
        return dict(plan=plan)
    if swap == 'none' and args.mita_cfg:
        parser.error('--mita-cfg needs --swap-attn mita (not none)')
    if isinstance(swap, MiTASetting):  # the whole setting, --mita-cfg keys over it
        rest = dict(args.mita_cfg or {})
        keys = {k: rest.pop(k) for k in list(rest) if k in SETTING_KEYS}
        try:
            return dict(rest, setting=swap.replace(**keys))
        except MiTASettingError as e:
            parser.error(f'--swap-attn {swap.text} with --mita-cfg: {e}')
    if swap == MITA or args.mita_cfg is not None:
        return dict(args.mita_cfg or {})
    return None


class SweepSwaps(NamedTuple):
    """What a sweep's ``--swap-attn`` / ``--mita-cfg`` / ``--mita-plan`` ask for
    (:func:`sweep_swaps`).

    Attributes:
        grid_cfg (dict): ``--mita-cfg``'s MiTA keys (``router_topk``...), over every
            ``(pool size, top-k)`` of the grid.
        swap_cfg (dict): its layer keys (``layers``, ``include_head``), for every swap.
        settings (list[MiTASetting]): whole settings to sweep besides the grid: the one of
            ``--swap-attn`` (any kind, ``--mita-cfg``'s keys over it, as
            :func:`swap_settings` reads it), then ``more``.
        plans (list[SwapPlan]): the plan of ``--mita-plan``, if any.
    """
    grid_cfg: Dict[str, Any]
    swap_cfg: Dict[str, Any]
    settings: List[MiTASetting]
    plans: List[Any]


def sweep_swaps(parser: argparse.ArgumentParser, args: argparse.Namespace,
                pool_sizes: Sequence[int], more: Sequence[MiTASetting] = ()) -> SweepSwaps:
    """The swaps of a tool that sweeps MiTA's ``(pool size, top-k)`` grid
    (``tools/swap_sweep.py``; :func:`add_mita_args` with ``swap_flag=False`` and
    ``exclude=('pool_size', 'topk')``): :func:`swap_settings` reads ``--swap-attn``,
    ``--mita-cfg`` and ``--mita-plan`` as every tool does, and a whole setting or a plan
    becomes one more point of the sweep.

    Raises:
        SystemExit: what :func:`swap_settings` refuses; a key of another kind in
            ``--mita-cfg`` (``window=5``) without a whole setting of that kind; a
            ``router_topk`` above the ``M`` landmarks of one of ``pool_sizes`` (usage
            errors, status 2).
    """
    swap = swap_settings(parser, args) or {}
    mita_cfg = dict(args.mita_cfg or {})
    whole = isinstance(getattr(args, 'swap_attn', None), MiTASetting)
    others = [k for k in mita_cfg if k in SETTING_KEYS and k not in MITA_KEYS]
    if others and not whole:
        parser.error(f'--mita-cfg {others[0]}={mita_cfg[others[0]]!r}: the swept grid '
                     '(pool sizes x top-ks) is MiTA\'s, which has no such key; give it with '
                     'a whole setting of its kind (--swap-attn agent:7, block:8:4, window:7...)')
    if mita_cfg:     # router_topk at most the M = P*P landmarks of every pool swept
        try:
            check_mita_cfg(mita_cfg, ('pool_size', 'topk'), pool_sizes=pool_sizes)
        except ValueError as e:
            parser.error(f'--mita-cfg with --pool-sizes {min(pool_sizes)}: {e}')
    return SweepSwaps(
        grid_cfg={k: v for k, v in mita_cfg.items() if k in MITA_KEYS},
        swap_cfg={k: v for k, v in mita_cfg.items() if k not in SETTING_KEYS},
        settings=([swap['setting']] if whole else []) + list(more),
        plans=[swap['plan']] if 'plan' in swap else [])
