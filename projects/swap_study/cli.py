"""The command line of ``tools/swap_study.py``: the argument types of its settings
(``7:49+tome0.5``, plan budgets, calibration candidates, numbers in a range) and the arguments
of :class:`~projects.swap_study.settings.StudySettings`' fields, their defaults the settings'.
The project's own argparse types (``mita_seg.cli`` is the tools' command line, not a library
a project builds on), with the messages of the tools' types; no torch or mm stack at import."""
import argparse
from typing import Callable, Optional

from mita_seg.setting import MITA, OTHER_KINDS, MiTASetting, MiTASettingError
from .settings import MODEL_TRAIN_ITERS, default

__all__ = ['int_range', 'float_range', 'setting_arg', 'merge_ratio', 'merged_swap', 'spelled',
           'plan_budget', 'train_iters', 'mita_budget', 'add_study_args']


def _number_range(cast: type, low=None, high=None, low_open: bool = False) -> Callable:
    """An argparse ``type``: ``cast(text)`` in ``[low, high]`` (``(low, high]`` with
    ``low_open``; a bound None is open), else a usage error naming the text and the bounds."""
    bounds = ' and '.join(([f'{">" if low_open else ">="} {low}'] if low is not None else [])
                          + ([f'<= {high}'] if high is not None else []))

    def check(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f'{text!r} is not {"an int" if cast is int else "a number"}'
                + (f' ({bounds})' if bounds else '')) from None
        if value != value or (low is not None and (value < low or (low_open and value == low))) \
                or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f'{text!r}: must be {bounds}')
        return value
    check.__name__ = cast.__name__
    return check


def int_range(low: Optional[int] = None, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type``: an int in ``[low, high]`` (a bound None is open)."""
    return _number_range(int, low, high)


def float_range(low: Optional[float] = None, high: Optional[float] = None,
                low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a number in ``[low, high]`` (``(low, high]`` with
    ``low_open``; a bound None is open)."""
    return _number_range(float, low, high, low_open)


def setting_arg(text: str) -> MiTASetting:
    """An argparse ``type``: :meth:`MiTASetting.parse` (a bad one is a usage error)."""
    try:
        return MiTASetting.parse(text)
    except MiTASettingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def merge_ratio(text: str) -> float:
    """An argparse ``type``: a ToMe merge ratio, a number in ``[0, 0.5]``
    (:func:`mita_seg.ops.token_merge.check_ratio`, imported when one is given)."""
    from mita_seg.ops.token_merge import MAX_MERGE_RATIO, check_ratio
    try:
        return check_ratio(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            str(e) if 'outside' in str(e) else
            f'{text!r} is not a number: give the fraction of grid tokens merged, in '
            f'[0, {MAX_MERGE_RATIO}], e.g. 0.3') from None


def merged_swap(text):
    """``'7:49+tome0.5'`` -> ``(MiTASetting 7:49, 0.5)``: MiTA with ToMe at ratio 0.5."""
    setting, sep, ratio = text.partition('+tome')
    try:
        value = MiTASetting.parse(setting), merge_ratio(ratio)
        if not sep:
            raise ValueError
    except (ValueError, argparse.ArgumentTypeError):
        old = text.split(',')
        hint = (f' ({text!r} is the old spelling: write {old[0]}:{old[1]}+tome{old[2]})'
                if len(old) == 3 else '')
        raise argparse.ArgumentTypeError(
            f'{text!r}: give SETTING+tomeRATIO, e.g. 7:49+tome0.5 (a MiTA setting, ToMe at a '
            f'ratio in [0, 0.5]){hint}') from None
    return value


def spelled(text):
    """A candidate: ``dense`` or a MiTA setting, as its spelling."""
    try:
        setting = MiTASetting.parse_or_dense(text)
    except MiTASettingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return 'dense' if setting is None else setting.text


def plan_budget(text):
    """A MiTA setting (the FLOPs of every layer on it, e.g. ``7:49``) or ``'tome'``."""
    if text == 'tome':
        return text
    try:
        return MiTASetting.parse(text).text
    except MiTASettingError as e:
        raise argparse.ArgumentTypeError(
            f"{e}; or 'tome' (the FLOPs of the largest --merge-ratios)") from None


def train_iters(text):
    """A number of iterations (>= 1), or ``'config'`` (each config's own schedule)."""
    if text == 'config':
        return text
    try:
        return int_range(1)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; or 'config' (each config's own "
                                         'schedule)') from None


def mita_budget(text):
    """A MiTA setting (``7:49``) whose attention MACs are a budget of the taxonomy."""
    setting = setting_arg(text)
    if setting.kind != MITA:
        raise argparse.ArgumentTypeError(f'{text!r}: a budget is a MiTA setting (7:49), the '
                                         'other kinds are matched to its cost')
    return setting


def add_study_args(add):
    """What the study runs: ``StudySettings``' fields, their defaults the settings'."""
    D = default
    add('--seeds', type=int_range(0), nargs='+', default=list(D('seeds')),
        help='training seeds: every model is trained and studied once per seed '
        '(randomness.seed); rows are mean and spread over them')
    add('--train-iters', type=train_iters, help="training iterations on the study's "
        "schedule (warm-up, poly decay), or 'config': each config's own schedule (default: "
        "the dataset's: local 120, longrange 'config')")
    iters = [f'{k}={v}' for k, v in MODEL_TRAIN_ITERS.items()]
    add('--model-train-iters', nargs='*', metavar='NAME=ITERS',
        help='training iterations of some models instead of --train-iters (default on the '
        f"local scenes: {' '.join(iters)}, the tiny BEiT barely uses its attention after 120; "
        'see docs/swap_study.md)')
    add('--finetune-iters', type=int_range(1), help="fine-tune and control iterations "
        "(default: the dataset's: local 40, longrange 100)")
    add('--finetune-lr-mult', type=float_range(0, low_open=True), default=D('finetune_lr_mult'),
        help="fine-tune learning rate as a multiple of the config's")
    add('--pool-sizes', type=int_range(1), nargs='+', default=list(D('pool_sizes')),
        help='landmark grid sides P of the sweep (M = P*P)')
    add('--topks', type=int_range(1), nargs='+', default=list(D('topks')),
        help='keys per routed expert of the sweep')
    add('--finetune', type=setting_arg, nargs='*', default=list(D('finetune')), metavar='P:K',
        help='settings to export and fine-tune (none: no fine-tune)')
    add('--selection', type=setting_arg, default=D('selection'), metavar='P:K',
        help='setting of the token-selection maps')
    add('--selection-images', type=int_range(0), default=D('selection_images'),
        help='validation images of the token-selection maps (0: no maps)')
    add('--merge-ratios', type=merge_ratio, nargs='*', default=list(D('merge_ratios')),
        metavar='R', help='ToMe (token merging) ratios beside the sweep (none: no ToMe rows)')
    add('--head-settings', type=setting_arg, nargs='*', default=list(D('head_settings')),
        metavar='P:K', help="settings at which Segmenter's mask head is swapped too, its "
        'class tokens global and, as a second row, routed like patches (none: no such rows)')
    add('--no-merge-head', dest='merge_head', action='store_false',
        help="no ToMe rows with Segmenter's mask head merged (only the encoder's)")
    add('--merged-swaps', type=merged_swap, nargs='*', default=list(D('merged_swaps')),
        metavar='P:K+tomeR', help='MiTA at a setting with ToMe at ratio R together, e.g. '
        '7:49+tome0.5')
    add('--kind-budgets', type=mita_budget, nargs='*', default=list(D('kind_budgets')),
        metavar='P:K', help='budgets of the taxonomy: each of --kinds, MiTA and ToMe at the '
        "encoder attention MACs of each of these MiTA settings (none: no such rows)")
    add('--kinds', nargs='+', default=list(D('kinds')),
        choices=list(OTHER_KINDS), help='attention kinds set beside MiTA')
    add('--plan-budgets', type=plan_budget, nargs='*', default=list(D('plan_budgets')),
        metavar='P:K|tome', help='FLOP budgets of the calibrated per-layer plans (none: no '
        'plans)')
    add('--calibration-images', type=int_range(1), default=D('calibration_images'),
        help='training images each plan is calibrated on')
    add('--calibration-counts', type=int_range(1), nargs='*',
        default=list(D('calibration_counts')), metavar='N',
        help='also calibrate the first budget on N images')
    add('--candidates', dest='calibration_candidates', nargs='+', type=spelled, metavar='C',
        default=None, help='per-layer candidates of the calibration (dense, P:K, P:K:route; '
        "default: P 4 to 10 x k 8/16, 7:49, two route-only, dense: a finer grid than "
        "tools/calibrate_swap.py's default, see docs/swap_study.md)")
    add('--native', type=setting_arg, nargs='*', default=list(D('native')), metavar='P:K',
        help='also train the model from scratch with MiTA at each setting and evaluate it '
        'over the grid (none: no such runs)')
    add('--native-models', nargs='+', metavar='NAME', help='the models that get the '
        f"--native runs (default: those of {', '.join(D('native_models'))} in the study)")
    add('--no-control', dest='control', action='store_false',
        help='skip training the unswapped model as long as the fine-tune')
    add('--no-check', dest='exact_check', action='store_false',
        help='skip the two check rows: route-only with every key (must equal unswapped) '
        'and every token reading one key (1:1:route, no token mixing)')
    add('--speed-time', dest='speed_min_run_time', metavar='SPEED_TIME',
        type=float_range(0, low_open=True), default=D('speed_min_run_time'),
        help='seconds of timing per row for images/s')
