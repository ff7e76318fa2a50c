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

Usage::

    python tools/swap_study.py [--models segmenter beit] [--model NAME=CONFIG ...]
        [--seeds 2027 2028 2029] [--head-settings 7:49]
        [--work-dir work_dirs/swap_study] [--fig-dir DIR] [--data-root DIR]
        [--train-iters 120] [--model-train-iters beit=400] [--finetune-iters 40]
        [--pool-sizes 4 5 7 8 10] [--topks 8 16 49 100] [--candidates dense 4:8 ...]
        [--finetune 7:49 ...] [--selection 7:49] [--no-control] [--reuse] [--threads N]
        [--merge-ratios 0.2 0.3 0.4 0.5] [--merged-swaps 7:49+tome0.5] [--plan-budgets 7:49 tome]
        [--calibration-images 16] [--calibration-counts 4 8] [--native 4:16 7:49]
        [--native-models segmenter]

A trained standard-attention checkpoint at ``WORK_DIR/<model>/seed<seed>/train/iter_<iters>.pth``
is used as it is with ``--reuse`` (e.g. one trained by ``tools/train.py`` with the study's
schedule and that ``randomness.seed``).

A MiTA setting is spelled as everywhere (:mod:`mita_seg.setting`): ``7:49`` (pool 7 x 7, top-k
49), ``4x6:16`` (a 4 x 6 pool), ``7:49:route`` (route-only); MiTA with ToMe as
``7:49+tome0.5``.
"""
import argparse
import os.path as osp
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

from mita_seg.utils.cli import (KeyValueAction, float_range, int_range,  # noqa: E402
                               output_dir)
from mita_seg.apis.mita_cfg import add_dense_attn_arg  # noqa: E402
from mita_seg.apis.token_merge import merge_ratio  # noqa: E402
from mita_seg.setting import (MiTASetting, MiTASettingError, setting_arg,  # noqa: E402
                              setting_or_dense_arg)

# The study's models: standard-attention configs on the 256x256 data (32x32 grid).
MODELS = {
    'segmenter': 'configs/baselines/segmenter_vit-tiny_mask_1xb4_tiny-ade20k-256x256.py',
    'beit': 'configs/baselines/beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py',
}
DATA_ROOT = 'data/ade/tiny_ade20k_256'


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='MiTA swap study: train, swap without retraining, fine-tune, measure')
    parser.add_argument('--models', nargs='+', choices=sorted(MODELS),
                        help='models of the study (default without --model: every one whose '
                        'config exists; '
                        f"{', '.join(f'{k}: {v}' for k, v in MODELS.items())})")
    parser.add_argument('--model', action='append', default=[], metavar='NAME=CONFIG',
                        help='a further standard-attention model (config file or mmseg::)')
    parser.add_argument('--work-dir', type=output_dir('--work-dir'),
                        default='work_dirs/swap_study')
    parser.add_argument('--fig-dir', type=output_dir('--fig-dir'),
                        help='figures (default: WORK_DIR/figures)')
    parser.add_argument('--data-root', type=output_dir('--data-root'), default=DATA_ROOT,
                        help='ADE20K-format data; written if missing (see --data-*)')
    parser.add_argument('--data-size', type=int_range(32), default=256,
                        help='image side if written')
    parser.add_argument('--data-train', type=int_range(1), default=200,
                        help='training images if written')
    parser.add_argument('--data-val', type=int_range(1), default=40,
                        help='validation images if written')
    parser.add_argument('--seeds', type=int_range(0), nargs='+', default=[2027, 2028, 2029],
                        help='training seeds: every model is trained and studied once per seed '
                        '(randomness.seed); rows are mean and spread over them')
    parser.add_argument('--train-iters', type=int_range(1), default=120)
    parser.add_argument('--model-train-iters', nargs='*', default=['beit=400'],
                        metavar='NAME=ITERS', help='training iterations of some models '
                        'instead of --train-iters (default: beit=400, the tiny BEiT barely uses '
                        'its attention after 120; see docs/swap_study.md)')
    parser.add_argument('--finetune-iters', type=int_range(1), default=40)
    parser.add_argument('--finetune-lr-mult', type=float_range(0, low_open=True), default=0.1,
                        help="fine-tune learning rate as a multiple of the config's")
    parser.add_argument('--pool-sizes', type=int_range(1), nargs='+', default=[4, 5, 7, 8, 10],
                        help='landmark grid sides P of the sweep (M = P*P)')
    parser.add_argument('--topks', type=int_range(1), nargs='+', default=[8, 16, 49, 100],
                        help='keys per routed expert of the sweep')
    parser.add_argument('--finetune', type=setting_arg, nargs='*',
                        default=[MiTASetting.parse('7:49')], metavar='P:K',
                        help='settings to export and fine-tune (none: no fine-tune)')
    parser.add_argument('--selection', type=setting_arg, default=MiTASetting.parse('7:49'),
                        metavar='P:K', help='setting of the token-selection maps')
    parser.add_argument('--selection-images', type=int_range(0), default=2,
                        help='validation images of the token-selection maps (0: no maps)')
    parser.add_argument('--merge-ratios', type=merge_ratio, nargs='*',
                        default=[0.2, 0.3, 0.4, 0.5], metavar='R',
                        help='ToMe (token merging) ratios beside the sweep (none: no ToMe rows)')
    parser.add_argument('--head-settings', type=setting_arg, nargs='*',
                        default=[MiTASetting.parse('7:49')], metavar='P:K',
                        help="settings at which Segmenter's mask head is swapped too, its class "
                        'tokens global and, as a second row, routed like patches (none: no such '
                        'rows)')
    parser.add_argument('--no-merge-head', action='store_true',
                        help="no ToMe rows with Segmenter's mask head merged (only the encoder's)")
    parser.add_argument('--merged-swaps', type=merged_swap, nargs='*',
                        default=[(MiTASetting.parse('7:49'), 0.5)], metavar='P:K+tomeR',
                        help='MiTA at a setting with ToMe at ratio R together, e.g. '
                        '7:49+tome0.5')
    parser.add_argument('--plan-budgets', type=plan_budget, nargs='*',
                        default=['7:49', '7:16', '4:16', 'tome'], metavar='P:K|tome',
                        help='FLOP budgets of the calibrated per-layer plans (none: no plans)')
    parser.add_argument('--calibration-images', type=int_range(1), default=16,
                        help='training images each plan is calibrated on')
    parser.add_argument('--calibration-counts', type=int_range(1), nargs='*', default=[4, 8],
                        metavar='N', help='also calibrate the first budget on N images')
    parser.add_argument('--candidates', nargs='+', type=spelled, metavar='C', default=None,
                        help='per-layer candidates of the calibration (dense, P:K, '
                        "P:K:route; default: P 4 to 10 x k 8/16, 7:49, two route-only, dense: "
                        "a finer grid than tools/calibrate_swap.py's default, see "
                        'docs/swap_study.md)')
    parser.add_argument('--native', type=setting_arg, nargs='*',
                        default=[MiTASetting.parse(t) for t in ('4:16', '7:49')],
                        metavar='P:K', help='also train the model from scratch with MiTA at '
                        'each setting and evaluate it over the grid (none: no such runs)')
    parser.add_argument('--native-models', nargs='+', default=['segmenter'], metavar='NAME',
                        help='the models that get the --native runs')
    parser.add_argument('--no-control', action='store_true',
                        help='skip training the unswapped model as long as the fine-tune')
    parser.add_argument('--no-check', action='store_true',
                        help='skip the route-only every-key row (must equal unswapped)')
    parser.add_argument('--speed-time', type=float_range(0, low_open=True), default=1.0,
                        help='seconds of timing per row for images/s')
    parser.add_argument('--threads', type=int_range(1), help="torch's intra-op threads (default: "
                        "torch's choice)")
    parser.add_argument('--workers', type=int_range(0), default=0,
                        help='dataloader worker processes')
    parser.add_argument('--reuse', action='store_true',
                        help='reuse results and checkpoints of the work dir made with the '
                        'same settings (to add a model to a finished study)')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override settings of every config, key=value')
    add_dense_attn_arg(parser)
    parser.add_argument('--verbose', action='store_true',
                        help="print the Runner's config dumps and per-class tables")
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
    from projects.swap_study import StudySettings, run_swap_study
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
    settings = StudySettings(
        data_root=args.data_root, seeds=tuple(args.seeds), train_iters=args.train_iters,
        model_train_iters=args.model_train_iters,
        finetune_iters=args.finetune_iters, finetune_lr_mult=args.finetune_lr_mult,
        pool_sizes=tuple(args.pool_sizes), topks=tuple(args.topks),
        finetune=tuple(args.finetune), control=not args.no_control,
        exact_check=not args.no_check, selection=args.selection,
        selection_images=args.selection_images, speed_min_run_time=args.speed_time,
        merge_ratios=tuple(args.merge_ratios), merge_head=not args.no_merge_head,
        head_settings=tuple(args.head_settings),
        merged_swaps=tuple(args.merged_swaps), plan_budgets=tuple(args.plan_budgets),
        calibration_images=args.calibration_images,
        calibration_counts=tuple(args.calibration_counts),
        **({} if args.candidates is None else
           dict(calibration_candidates=tuple(args.candidates))),   # None: the study's
        native=tuple(args.native), native_models=tuple(args.native_models),
        workers=args.workers, cfg_options=args.cfg_options, reuse=args.reuse,
        verbose=args.verbose)
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
    from mita_seg.utils.cli import run_tool
    run_tool(lambda: main(ARGS))
