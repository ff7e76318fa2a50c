"""Write the long-range scenes (:mod:`mita_seg.datasets.longrange_scenes`: labels that need
evidence 8-30 patches away) in ADE20K's layout; docs/longrange_data.md.

Usage::

    python tools/dataset/make_longrange_ade20k.py --out data/ade/longrange_ade20k \\
        --train 2400 --val 200 --size 256
    python tools/dataset/make_longrange_ade20k.py --kinds global,detail   # cue only
    python tools/dataset/make_longrange_ade20k.py --layout v2 --train 600   # v2 as measured
    python tools/dataset/make_longrange_ade20k.py --preview docs/figures/longrange_scenes.png
"""
import argparse
from typing import Tuple
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))
from mita_seg.cli import ToolParser, run_tool  # noqa: E402
from mita_seg.datasets.ade_layout import check_split_folders  # noqa: E402
from mita_seg.datasets.longrange_scenes import (CLASS_NAMES, DEFAULT_LAYOUT, KINDS,  # noqa: E402
                                                LAYOUTS, classes, make_split, preview,
                                                write_scenes_file)


def parse_kinds(text: str) -> Tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(',') if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(
            f'--kinds: give a comma-separated subset of {",".join(KINDS)}, got {text!r}')
    return tuple(k for k in KINDS if k in kinds)


def parse_args(argv=None):
    parser = ToolParser(
        description='Write a synthetic ADE20K-layout dataset whose labels need long-range '
        'evidence (a global cue, retrieval of a distant object, fine detail)')
    parser.add_argument('--out', default='data/ade/longrange_ade20k', help='output folder')
    parser.add_argument('--train', type=int, default=2400, help='training images')
    parser.add_argument('--val', type=int, default=200, help='validation images')
    parser.add_argument('--size', type=int, default=256,
                        help='image side in pixels (256: the study\'s 32x32 grid of 8-px '
                        'patches)')
    parser.add_argument('--seed', type=int, default=0, help='random seed')
    parser.add_argument('--kinds', type=parse_kinds, default=KINDS,
                        help=f'evidence kinds a scene mixes, comma-separated (default: '
                        f'{",".join(KINDS)})')
    parser.add_argument('--cues', type=int, default=2, choices=(2, 3),
                        help='how many cues (classes per texture) the global kind uses')
    parser.add_argument('--layout', default=DEFAULT_LAYOUT, choices=sorted(LAYOUTS),
                        help=f'sizes of the evidence (default {DEFAULT_LAYOUT}): v4 a 6x6-cell '
                        'cue, 3 pairs with large textured partners, region boundaries and poles '
                        'finer than a patch; v3 the same with smooth boundaries; v2 smaller '
                        'partners; v1 the first scenes (3x3 cue, 2-3 pairs)')
    parser.add_argument('--preview', metavar='FILE',
                        help='write a PNG of the first validation scenes and their labels to '
                        'FILE instead of the dataset')
    parser.add_argument('--preview-count', type=int, default=4, help='scenes in --preview')
    args = parser.parse_args(argv)
    from mita_seg.cli import output_dir, output_file   # what is written can be written
    try:
        if args.preview is None:
            output_dir('--out')(args.out)
        else:
            output_file('--preview')(args.preview)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if args.train < 1 or args.val < 1:
        parser.error(f'--train and --val must be >= 1, got {args.train} and {args.val}')
    if args.size < 64:
        parser.error(f'--size must be >= 64 pixels (a 32x32 grid of cells of 2 pixels), got '
                     f'{args.size}')
    if args.preview_count < 1:
        parser.error(f'--preview-count must be >= 1, got {args.preview_count}')
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.preview:
        preview(args.preview, args.preview_count, args.size, args.seed, args.kinds, args.cues,
                args.layout)
        print(f'wrote {args.preview}: {args.preview_count} validation scenes of seed '
              f'{args.seed} ({args.size}x{args.size}, kinds {",".join(args.kinds)})')
        return
    check_split_folders(args.out, {'training': args.train, 'validation': args.val})
    for split, num in (('training', args.train), ('validation', args.val)):
        make_split(args.out, split, num, args.size, args.seed, args.kinds, args.cues,
                   args.layout)
    write_scenes_file(args.out, layout=args.layout, seed=args.seed, size=args.size,
                      kinds=list(args.kinds), cues=args.cues, train=args.train, val=args.val)
    names = ', '.join(f'{c}={CLASS_NAMES[c]}' for c in classes(args.kinds, args.cues))
    print(f'wrote {args.train} training and {args.val} validation images '
          f'({args.size}x{args.size}, kinds {",".join(args.kinds)}, {args.cues} cues, layout '
          f'{args.layout}) to '
          f'{args.out}; labels: 0=other (the cue), {names}')


if __name__ == '__main__':
    run_tool(main)
