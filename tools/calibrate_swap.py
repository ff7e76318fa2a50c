"""Choose per-layer attention settings for a FLOP budget from a few training images (a swap
plan), for a checkpoint trained with standard attention, with no retraining (a MiTA config's
checkpoint too: MiTA has no parameters, so it is calibrated against its dense model, the same
weights with every layer on standard attention, and says so).

Usage::

    python tools/calibrate_swap.py CONFIG CHECKPOINT
        (--reduction 0.4 | --budget-gflops G | --budget-uniform 7:49)
        --out PLAN.json [--images 16] [--candidates dense 7:49 5:16:route agent:7 ...]
        [--seed 0]
        [--cfg-options key=value ...]

On ``--images`` images drawn (``--seed``) from the config's *training* split (never the
evaluation images), measures the error each candidate setting of each attention layer causes
in the segmentation logits (mean per-pixel KL against the dense model, only that layer
swapped), counts each candidate's FLOPs with the project's counter (one crop at the config's
crop size, else 512x512, as ``tools/get_flops.py``; the output says which), and chooses the
plan of least total error within the budget (a multiple-choice knapsack over layers;
:func:`mita_seg.apis.calibrate_swap`).
Candidates: ``dense`` and any setting of any kind, spelt as every tool spells one: MiTA's
``P:K`` (pool P x P, top-k K, shared expert; ``PhxPw:K`` a Ph x Pw pool) and ``P:K:route``
(route-only), and the taxonomy's ``agent:7``, ``block:8:4``, ``topk:49``, ``window:7``; a
plan may mix them. By default dense and MiTA at P 4/5/7 x K 16/49/100, with the shared
expert and route-only. Writes the plan (``--mita-plan PLAN.json`` of ``tools/test.py``,
``get_flops.py``, ``export_swapped.py``, ``image_demo.py``, ``swap_sweep.py``) and prints it
as a table.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mita_seg.cli import (KeyValueAction, add_dense_attn_arg, checkpoint_file,  # noqa: E402
                          config_file, ensure_parent, float_range, int_range, output_file,
                          python_command, quiet_stack, run_tool, setting_or_dense_arg)
from mita_seg.cli.core import ToolParser  # noqa: E402
from mita_seg.setting import CALIBRATION_CANDIDATES  # noqa: E402


def budget_uniform_arg(text: str):
    """``--budget-uniform``'s ``type``: a setting (:func:`setting_or_dense_arg`); ``dense``
    is refused by name (every layer dense costs the dense model's FLOPs: ``--reduction 0``
    asks for that plan)."""
    setting = setting_or_dense_arg(text)
    if setting is None:
        raise argparse.ArgumentTypeError(
            f'--budget-uniform {text}: every layer dense costs the dense model\'s FLOPs, and '
            'the plan for that budget is dense everywhere: give --reduction 0 for it, or a '
            'setting such as 7:49 or agent:7')
    return setting


def parse_args(argv=None):
    parser = ToolParser(
        description='Per-layer attention settings (dense, MiTA or another kind) for a FLOP '
        'budget, from a few training images')
    parser.add_argument('config', type=config_file, help='config of the standard-attention '
                        "model (a file or 'mmseg::<dir>/<config>.py'), or a MiTA config: "
                        'calibrated against its dense model (the same weights)')
    parser.add_argument('checkpoint', type=checkpoint_file, help='its checkpoint')
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument('--reduction', type=float_range(0, 1),
                        help='FLOPs to save, as a fraction of the dense model\'s (0.4: the '
                        'plan costs at most 60%% of dense)')
    budget.add_argument('--budget-gflops', type=float_range(0, low_open=True),
                        help='the plan\'s FLOPs at most this (GFLOPs of one crop at the '
                        'config\'s crop size, else 512x512, as tools/get_flops.py counts)')
    budget.add_argument('--budget-uniform', type=budget_uniform_arg, metavar='SETTING',
                        help='the FLOPs of every layer on this setting, e.g. 7:49 or agent:7 '
                        '(one of the candidates): the plan for the cost of that uniform swap')
    parser.add_argument('--out', required=True, type=output_file('--out', ('.json', )),
                        help='the plan file to write (JSON)')
    parser.add_argument('--images', type=int_range(1), default=16,
                        help='calibration images from the training split (default: 16)')
    parser.add_argument('--candidates', nargs='+', type=setting_or_dense_arg,
                        default=list(CALIBRATION_CANDIDATES), metavar='SETTING',
                        help='candidate settings of every layer, any kind, mixed as the '
                        'budget allows: dense, MiTA 7:49 (shared expert), 4x6:16, 7:49:route '
                        '(route-only), agent:7 (compression only), block:8:4 (block routing), '
                        'topk:49 (per-query top-k), window:7 (a local window) (default: dense '
                        'and MiTA P 4/5/7 x K 16/49/100, with the shared expert and '
                        'route-only)')
    parser.add_argument('--seed', type=int_range(0), default=0, help='which training images')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override config settings, key=value')
    add_dense_attn_arg(parser)
    args = parser.parse_args(argv)
    if args.reduction is not None and not 0 <= args.reduction < 1:
        parser.error(f'--reduction must be in [0, 1), got {args.reduction}')
    return args


def main(argv=None):
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.analysis.plan_report import format_plan
    from mita_seg.apis import calibrate_swap, config_name   # the stack, once parsed
    plan = calibrate_swap(
        args.config, args.checkpoint, args.reduction, args.budget_gflops, args.images,
        args.candidates, args.seed, args.cfg_options,
        progress=lambda line: print(f'[calibrate_swap] {line}', file=sys.stderr, flush=True),
        budget_uniform=args.budget_uniform)
    plan.info['model']['config'] = str(args.config)
    plan.save(ensure_parent(args.out))
    plan.source = args.out
    print(f'{config_name(args.config)}: swap plan')
    print(format_plan(plan))
    if plan.info['model'].get('config_attention'):
        print(f'calibrated against the dense model: the config\'s attention '
              f'({plan.info["model"]["config_attention"]}) put on standard attention, the '
              'same weights')
    test = python_command(osp.join(osp.dirname(osp.abspath(__file__)), 'test.py'),
                          args.config, args.checkpoint, '--mita-plan', args.out)
    print(f'wrote {args.out}\nuse: {test}')
    return plan


if __name__ == '__main__':
    run_tool(main)
