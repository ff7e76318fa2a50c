"""Export a MiTA config + checkpoint pair from a standard-attention one.

The written config is the original one (all bases merged) with the backbone switched to
``MiTAVisionTransformer`` (``MiTABEiT`` / ``MiTAMAE`` for BEiT / MAE) and, with
``include_head=True`` or a plan that names its layers, Segmenter's mask head to
``MiTASegmenterMaskTransformerHead``;
the checkpoint holds the very same weights (MiTA adds no parameters). Both models are built
and the checkpoint is loaded into each strictly before anything is written
(:func:`mita_seg.apis.export_swapped`). ``tools/test.py OUT_CONFIG OUT_CKPT`` (or mmseg's
own ``tools/test.py``) evaluates the pair; ``tools/train.py OUT_CONFIG`` fine-tunes from it.

Usage::

    python tools/export_swapped.py CONFIG CHECKPOINT --out-dir DIR
        [--mita-cfg pool_size=7 topk=49 router_topk=1 with_shared_expert=True
                    layers=[0,1] include_head=True | --mita-plan PLAN.json]
        [--cfg-options key=value ...]

With ``--mita-plan`` the written config carries the plan's per-layer settings
(``mita_layer_cfgs`` of the backbone and the Segmenter head; None: standard attention).
"""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.cli import (KeyValueAction, add_mita_args, checkpoint_file, config_file,  # noqa: E402
                          output_dir, python_command, quiet_stack, run_tool, swap_settings)
from mita_seg.cli.core import ToolParser  # noqa: E402

TOOLS = osp.dirname(osp.abspath(__file__))


def parse_args(argv=None):
    parser = ToolParser(description='Write a MiTA config + checkpoint pair')
    parser.add_argument('config', type=config_file, help="config of the standard-attention "
                        "model (a file or 'mmseg::<dir>/<config>.py')")
    parser.add_argument('checkpoint', type=checkpoint_file, help='its checkpoint')
    parser.add_argument('--out-dir', type=output_dir('--out-dir'), required=True,
                        help='where to write the pair (made if missing)')
    add_mita_args(parser, swap_flag=False)
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override config settings before exporting, key=value')
    args = parser.parse_args(argv)
    args.mita = swap_settings(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.apis import export_swapped
    out_cfg, out_ckpt = export_swapped(args.config, args.checkpoint, args.out_dir,
                                       args.mita, args.cfg_options)
    # runnable as printed: the interpreter running now (a venv's python), the tools' path
    test = python_command(osp.join(TOOLS, 'test.py'), out_cfg, out_ckpt)
    train = python_command(osp.join(TOOLS, 'train.py'), out_cfg)
    print(f'wrote {out_cfg}\nwrote {out_ckpt}\nevaluate: {test}\nfine-tune: {train}')
    return out_cfg, out_ckpt


if __name__ == '__main__':
    run_tool(main)
