"""The swap at the paper's token count: train, swap without retraining, fine-tune, measure.

For each standard-attention model (a tiny Segmenter and a tiny BEiT, each dataset's own) and
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
    python tools/swap_study.py --dataset longrange [--seeds S ...] [--reuse] ...
    python tools/swap_study.py --dataset longrange --check-discrimination --seeds S --work-dir W

``--dataset`` picks the scenes (local: a region's own pixels decide its label; longrange:
labels need distant evidence) and with them the models, data, schedule and work dir
(:data:`projects.swap_study.settings.DATASETS`); ``--kind-budgets`` the taxonomy's
comparison at equal cost (:mod:`projects.swap_study.kinds`); ``--paper-reduction`` the
paper's compression (MiTA at 42% fewer model FLOPs in the sweep, a budget of the taxonomy and
the plans); ``--no-plans-across-kinds`` the plans with MiTA candidates only.

A trained standard-attention checkpoint at ``WORK_DIR/<model>/seed<seed>/train/iter_<iters>.pth``
is used as it is with ``--reuse`` (e.g. one trained by ``tools/train.py`` with the study's
schedule and that ``randomness.seed``). With ``--reuse`` a run that was killed resumes: after
the last stage it finished (``WORK_DIR/<model>/seed<seed>/stages.json``), and a training cut
short from its last checkpoint (MMEngine's resume).
Settings are spelled as everywhere (``7:49``, ``4x6:16``, ``7:49:route``; ``7:49+tome0.5``).
"""
import argparse
import os.path as osp
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

from mita_seg.cli import (KeyValueAction, ToolParser, add_dense_attn_arg, int_range,  # noqa: E402
                          output_dir)
# the study's defaults (torch-free: parsed against before the stack is loaded)
from projects.swap_study.cli import add_study_args, float_range  # noqa: E402
from projects.swap_study.settings import DATA, DATASETS, StudySettings, default  # noqa: E402

MODEL_NAMES = sorted({n for d in DATASETS.values() for n in d.models})


def build_parser():
    """The tool's arguments, their defaults the study's (:mod:`projects.swap_study.settings`);
    an argument of a ``StudySettings`` field has its name as ``dest``."""
    p = ToolParser(
        description='MiTA swap study: train, swap without retraining, fine-tune, measure')
    add = p.add_argument
    add('--dataset', choices=sorted(DATASETS), default='local', help='the scenes: local '
        "(labels decided by a region's own pixels) or longrange (labels need distant evidence: "
        'docs/longrange_data.md); it sets the models, data, iterations and work dir below')
    add('--check-discrimination', action='store_true', help='longrange: only train and '
        'evaluate the global and the 3x3-window model per seed, one line each')
    add('--models', nargs='+', choices=MODEL_NAMES, help="models of the study (default "
        "without --model: every one of the dataset's whose config exists; "
        + '; '.join(f"{name}: {', '.join(f'{k}: {v}' for k, v in d.models.items())}"
                    for name, d in DATASETS.items()) + ')')
    add('--model', action='append', default=[], metavar='NAME=CONFIG',
        help='a further standard-attention model (config file or mmseg::)')
    add('--work-dir', type=output_dir('--work-dir'),
        help='default: ' + ', '.join(f'{k}: {d.work_dir}' for k, d in DATASETS.items()))
    add('--fig-dir', type=output_dir('--fig-dir'), help='figures (default: WORK_DIR/figures)')
    add('--data-root', type=output_dir('--data-root', if_missing=True),
        help='ADE20K-format data, written if missing (see --data-*); default: '
        + ', '.join(f'{k}: {d.data_root}' for k, d in DATASETS.items()))
    add('--data-size', type=int_range(32), default=DATA['size'], help='image side if written')
    add('--data-train', type=int_range(1), help='training images if written (default: '
        f"local {DATA['train']}, longrange the tool's)")
    add('--data-val', type=int_range(1), help='validation images if written (default: '
        f"local {DATA['val']}, longrange the tool's)")
    add_study_args(add)
    add('--paper-reduction', type=float_range(0, 0.99), default=default('paper_reduction'),
        metavar='FRACTION', help="the paper's compression: MiTA at the pool side whose "
        "model FLOPs come nearest this fraction below the unswapped model's, for each "
        '--paper-topks, in the sweep; the first also a budget of the taxonomy and the plans '
        '(0: no such rows)')
    add('--paper-topks', type=int_range(1), nargs='+', default=list(default('paper_topks')),
        metavar='K', help='the k of the settings at --paper-reduction')
    add('--no-plans-across-kinds', dest='plans_across_kinds', action='store_false',
        help='no calibrated plans across kinds (per-layer candidates of every kind of '
        '--kinds near each plan budget), only the MiTA plans')
    add('--threads', type=int_range(1), help="torch's intra-op threads (default: torch's choice)")
    add('--workers', type=int_range(0), default=default('workers'),
        help='dataloader worker processes')
    add('--reuse', action='store_true', help='reuse results and checkpoints of the work dir '
        'made with the same settings (to add a model to a finished study); a killed run '
        'resumes after its last finished stage, a killed training from its last checkpoint')
    add('--cfg-options', nargs='+', action=KeyValueAction,
        help='override settings of every config, key=value')
    add_dense_attn_arg(p)
    add('--verbose', action='store_true',
        help="print the Runner's config dumps and per-class tables")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    data = DATASETS[args.dataset]
    for key in ('work_dir', 'data_root', 'train_iters', 'finetune_iters'):
        if getattr(args, key) is None:
            setattr(args, key, getattr(data, key))
    if args.dataset == 'local':
        args.data_train = args.data_train or DATA['train']
        args.data_val = args.data_val or DATA['val']
    unknown = sorted(set(args.models or ()) - set(data.models))
    if unknown:
        parser.error(f'--models {unknown}: not a model of the {args.dataset} scenes '
                     f"({', '.join(data.models)}); give --model NAME=CONFIG for another")
    if args.models:
        models = [(n, data.models[n]) for n in args.models]
    elif args.model:
        models = []
    else:   # the default study: every model of the dataset whose config exists
        models = [(n, c) for n, c in data.models.items() if osp.isfile(osp.join(ROOT, c))]
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
    if args.check_discrimination and args.dataset != 'longrange':
        parser.error('--check-discrimination goes with --dataset longrange (the long-range '
                     'scenes are what it checks)')
    if args.model_train_iters is None:
        args.model_train_iters = [f'{k}={v}' for k, v in data.model_train_iters.items()]
    per_model = {}
    for item in args.model_train_iters:
        name, sep, iters = item.partition('=')
        if not sep or not iters.isdigit() or int(iters) < 1:
            parser.error(f'--model-train-iters {item!r}: give NAME=ITERS, e.g. beit=400')
        per_model[name] = int(iters)
    args.model_train_iters = per_model or None
    names = [n for n, _ in args.models]
    if args.native_models is None:     # the default's models that are in this study
        args.native_models = [n for n in default('native_models') if n in names]
    unknown = sorted(set(args.native_models) - set(names))
    if args.native and unknown:
        parser.error(f'--native-models {unknown}: not a model of this study '
                     f"({', '.join(names)}); name one of them")
    return args


def write_data(args):
    """The dataset's scenes, with its tool (``tools/dataset/``), unless already there."""
    if osp.isdir(osp.join(args.data_root, 'images')):
        if args.dataset == 'longrange':
            from mita_seg.datasets.longrange_scenes import DEFAULT_LAYOUT, scenes_layout
            try:
                layout = scenes_layout(args.data_root)
            except ValueError as e:
                raise SystemExit(f'error: {e}')
            if layout is None:   # the configs' evidence metric redraws scenes from it
                raise SystemExit(f'error: {args.data_root} holds long-range scenes without '
                                 'scenes.json (written before it existed), which the configs\' '
                                 'evidence metric needs to score them: delete the folder to '
                                 f'have {DEFAULT_LAYOUT} written')
            if layout != DEFAULT_LAYOUT:
                print(f'[swap_study] WARNING: {args.data_root} holds long-range scenes of layout '
                      f'{layout}; the configs\' schedule is set for '
                      f'layout {DEFAULT_LAYOUT}: delete the folder to have {DEFAULT_LAYOUT} '
                      'written', flush=True)
        return
    cmd = [sys.executable, osp.join(ROOT, 'tools', 'dataset', DATASETS[args.dataset].tool),
           '--out', args.data_root, '--size', str(args.data_size)]
    cmd += [a for k, v in (('--train', args.data_train), ('--val', args.data_val)) if v
            for a in (k, str(v))]
    print('[swap_study] $ ' + ' '.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main(argv=None):
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    write_data(args)
    if args.check_discrimination:
        from projects.swap_study.discrimination import run_check
        return run_check(args.seeds, args.work_dir, args.data_root, args.reuse, args.verbose)
    from projects.swap_study import run_swap_study
    skipped = sorted(set(DATASETS[args.dataset].models) - {n for n, _ in args.models})
    if skipped:
        print(f'[swap_study] not in this study: {", ".join(skipped)} '
              f'(config missing or not asked for)', flush=True)
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
