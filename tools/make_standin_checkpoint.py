"""Write a stand-in for a released checkpoint, offline: the model of CONFIG with seeded random
weights, in the model zoo's format (``meta`` + ``state_dict``). It loads strictly into the
same config and swaps to MiTA as the released one does, so the README's swap example and
every tool run without the internet; its segmentation is noise (nothing is trained).

Usage::

    python tools/make_standin_checkpoint.py CONFIG --out CKPT.pth [--seed 0]
        [--cfg-options key=value ...] [--force]

CONFIG is a file or ``mmseg::<dir>/<name>.py``. A file at ``--out`` that is neither empty
(what a failed download leaves) nor an earlier stand-in is kept unless ``--force``
(:func:`mita_seg.apis.make_standin_checkpoint`).
"""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.cli import (KeyValueAction, config_file, int_range, output_file,  # noqa: E402
                          quiet_stack, run_tool)
from mita_seg.cli.core import ToolParser  # noqa: E402


def parse_args(argv=None):
    parser = ToolParser(description=__doc__.split('\n\n')[0].replace('\n', ' '))
    parser.add_argument('config', type=config_file,
                        help="config file, or 'mmseg::<dir>/<config>.py'")
    parser.add_argument('--out', type=output_file('--out', ('.pth', )), required=True,
                        help='the checkpoint to write (its folder is made if missing)')
    parser.add_argument('--seed', type=int_range(0), default=0,
                        help='random seed of the weights (default: 0)')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override config settings, key=value')
    parser.add_argument('--force', action='store_true',
                        help='replace a file at --out that is not a stand-in')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.apis import make_standin_checkpoint
    r = make_standin_checkpoint(args.config, args.out, args.seed, args.cfg_options, args.force)
    print(f"wrote {r['path']}: {r['config']} with seeded random weights (seed {args.seed}, "
          f"{r['parameters'] / 1e6:.2f} M parameters, {r['bytes'] / 2**20:.1f} MB) in the "
          "model zoo's format; a stand-in, not trained: it loads, swaps and runs as the "
          'released checkpoint does, its segmentation is noise')
    return r


if __name__ == '__main__':
    run_tool(main)
