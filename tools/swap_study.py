"""The swap at the paper's token count: train, swap without retraining, fine-tune, measure.

For each standard-attention model (a tiny Segmenter, and a tiny BEiT once its config exists) and
each training seed (``--seeds``, three by default; every row is reported as mean ± sample std over
them) on the generated ADE20K-format data at 256x256 (patch 8: a 32x32 grid, N = 1025 tokens with
cls, the paper's token count): train it with MMEngine's Runner, evaluate it unswapped and swapped
to MiTA over a (pool size, top-k) sweep with no retraining (the encoder, as the paper; and the mask
head too at ``--head-settings``, its class tokens global, then routed), export and fine-tune the
swap at the paper's M = k = 49 (plus a control: the unswapped model trained as long), beside its
training-free peer ToMe (token merging) and per-layer plans calibrated for FLOP budgets, with model
GFLOPs and measured images/s on every row, and the token-selection maps; and the Segmenter trained
from scratch with MiTA (small and paper-size experts), evaluated over the same grid
(:func:`projects.swap_study.run_swap_study`). Writes ``WORK_DIR/swap_study.{json,md}``,
``FIG_DIR/swap_study.png``, ``FIG_DIR/<model>_native.png`` and the selection maps; ``make
swap-study`` runs it as in docs/swap_study.md.

Usage (``--help`` lists every option; the defaults are the study's,
:mod:`projects.swap_study.settings`)::

    python tools/swap_study.py [--models segmenter beit] [--seeds S ...] [--work-dir DIR] ...
    python tools/swap_study.py --dataset longrange --check-discrimination --seeds S --work-dir W

A trained standard-attention checkpoint at ``WORK_DIR/<model>/seed<seed>/train/iter_<iters>.pth``
is used as it is with ``--reuse`` (e.g. one trained by ``tools/train.py`` with the study's
schedule and that ``randomness.seed``).
Settings are spelled as everywhere (``7:49``, ``4x6:16``, ``7:49:route``; ``7:49+tome0.5``).
"""
import argparse
import os.path as osp
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

from mita_seg.cli import (KeyValueAction, add_dense_attn_arg, float_range,  # noqa: E402
                          int_range, merge_ratio, output_dir, setting_arg, setting_or_dense_arg)
from mita_seg.setting import MiTASetting, MiTASettingError  # noqa: E402
# the study's defaults (torch-free: parsed against before the stack is loaded)
from projects.swap_study.settings import (DATA, DATA_ROOT, MODEL_TRAIN_ITERS,  # noqa: E402
                                          MODELS, WORK_DIR, StudySettings, default)


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
    setting = setting_or_dense_arg(text)
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


def build_parser():
    """The tool's arguments, their defaults the study's (:mod:`projects.swap_study.settings`);
    an argument of a ``StudySettings`` field has its name as ``dest``."""
    p = argparse.ArgumentParser(
        description='MiTA swap study: train, swap without retraining, fine-tune, measure')
    add = p.add_argument
    add('--models', nargs='+', choices=sorted(MODELS), help='models of the study (default '
        'without --model: every one whose config exists; '
        f"{', '.join(f'{k}: {v}' for k, v in MODELS.items())})")
    add('--model', action='append', default=[], metavar='NAME=CONFIG',
        help='a further standard-attention model (config file or mmseg::)')
    add('--work-dir', type=output_dir('--work-dir'), default=WORK_DIR)
    add('--fig-dir', type=output_dir('--fig-dir'), help='figures (default: WORK_DIR/figures)')
    add('--data-root', type=output_dir('--data-root', if_missing=True), default=DATA_ROOT,
        help='ADE20K-format data; written if missing (see --data-*)')
    add('--dataset', choices=['local', 'longrange'], default='local', help='the scenes: local '
        '(labels decided by a region\'s own pixels) or longrange (docs/longrange_data.md)')
    add('--check-discrimination', action='store_true', help='longrange: only train and '
        'evaluate the global and the 3x3-window model per seed, one line each')
    add('--data-size', type=int_range(32), default=DATA['size'], help='image side if written')
    add('--data-train', type=int_range(1), default=DATA['train'], help='training images if written')
    add('--data-val', type=int_range(1), default=DATA['val'], help='validation images if written')
    add_study_args(add)
    add('--threads', type=int_range(1), help="torch's intra-op threads (default: torch's choice)")
    add('--workers', type=int_range(0), default=default('workers'),
        help='dataloader worker processes')
    add('--reuse', action='store_true', help='reuse results and checkpoints of the work dir '
        'made with the same settings (to add a model to a finished study)')
    add('--cfg-options', nargs='+', action=KeyValueAction,
        help='override settings of every config, key=value')
    add_dense_attn_arg(p)
    add('--verbose', action='store_true',
        help="print the Runner's config dumps and per-class tables")
    return p


def add_study_args(add):
    """What the study runs: ``StudySettings``' fields, their defaults the settings'."""
    D = default
    add('--seeds', type=int_range(0), nargs='+', default=list(D('seeds')),
        help='training seeds: every model is trained and studied once per seed '
        '(randomness.seed); rows are mean and spread over them')
    add('--train-iters', type=int_range(1), default=D('train_iters'))
    iters = [f'{k}={v}' for k, v in MODEL_TRAIN_ITERS.items()]
    add('--model-train-iters', nargs='*', default=iters, metavar='NAME=ITERS',
        help='training iterations of some models instead of --train-iters (default: '
        f"{' '.join(iters)}, the tiny BEiT barely uses its attention after 120; see "
        'docs/swap_study.md)')
    add('--finetune-iters', type=int_range(1), default=D('finetune_iters'))
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
    add('--native-models', nargs='+', default=list(D('native_models')), metavar='NAME',
        help='the models that get the --native runs')
    add('--no-control', dest='control', action='store_false',
        help='skip training the unswapped model as long as the fine-tune')
    add('--no-check', dest='exact_check', action='store_false',
        help='skip the route-only every-key row (must equal unswapped)')
    add('--speed-time', dest='speed_min_run_time', metavar='SPEED_TIME',
        type=float_range(0, low_open=True), default=D('speed_min_run_time'),
        help='seconds of timing per row for images/s')


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.models:
        models = [(n, MODELS[n]) for n in args.models]
    elif args.model:
        models = []
    else:   # the default study: every model whose config exists
        models = [(n, c) for n, c in MODELS.items() if osp.isfile(osp.join(ROOT, c))]
    for item in args.model:
        name, sep, config = item.partition('=')
        if not sep or not name or not config:
            parser.error(f'--model {item!r}: give NAME=CONFIG')
        models.append((name, config))
    missing = [c for _, c in models if '::' not in c and not osp.isfile(c)
               and not osp.isfile(osp.join(ROOT, c))]
    if missing:
        parser.error(f'config(s) not found: {missing}')
    args.models = [(n, c if osp.isfile(c) or '::' in c else osp.join(ROOT, c))
                   for n, c in models]
    if (args.dataset == 'longrange') != args.check_discrimination:
        parser.error('--check-discrimination goes with --dataset longrange: on the long-range '
                     'scenes the study runs only that check for now')
    per_model = {}
    for item in args.model_train_iters:
        name, sep, iters = item.partition('=')
        if not sep or not iters.isdigit() or int(iters) < 1:
            parser.error(f'--model-train-iters {item!r}: give NAME=ITERS, e.g. beit=400')
        per_model[name] = int(iters)
    args.model_train_iters = per_model or None
    unknown = sorted(set(args.native_models) - {n for n, _ in args.models})
    if args.native and unknown:
        parser.error(f'--native-models {unknown}: not a model of this study '
                     f"({', '.join(n for n, _ in args.models)}); name one of them")
    return args


def main(argv=None):
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.check_discrimination:
        from projects.swap_study.discrimination import LONGRANGE_ROOT, run_check
        root = LONGRANGE_ROOT if args.data_root == DATA_ROOT else args.data_root
        return run_check(args.seeds, args.work_dir, root, args.reuse, args.verbose)
    from projects.swap_study import run_swap_study
    skipped = sorted(set(MODELS) - {n for n, _ in args.models})
    if skipped:
        print(f'[swap_study] not in this study: {", ".join(skipped)} '
              f'(config missing or not asked for)', flush=True)
    if not osp.isdir(osp.join(args.data_root, 'images')):
        cmd = [sys.executable, osp.join(ROOT, 'tools', 'dataset', 'make_tiny_ade20k.py'),
               '--out', args.data_root, '--train', str(args.data_train), '--val',
               str(args.data_val), '--size', str(args.data_size)]
        print('[swap_study] $ ' + ' '.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    settings = StudySettings.from_values(vars(args))   # the arguments named as its fields
    try:
        study = run_swap_study(args.models, args.work_dir, settings, args.fig_dir)
    except ValueError as e:
        raise SystemExit(f'error: {e}')
    with open(study['outputs'][1]) as f:
        print('\n' + f.read())
    print('wrote ' + ', '.join(study['outputs'] + study['figures']))
    if study['errors']:
        print('\nerrors (the rows of these steps are missing):\n  ' +
              '\n  '.join(study['errors']), file=sys.stderr)
        sys.exit(1)
    return study


if __name__ == '__main__':
    ARGS = parse_args()   # a bad argument stops here, before anything is run
    from mita_seg.cli import run_tool
    run_tool(lambda: main(ARGS))
