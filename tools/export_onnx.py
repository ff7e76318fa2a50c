"""Export a segmentor to ONNX, MiTA as standard ONNX operators, checked in ONNX Runtime.

The graph takes the preprocessed image ``img`` ``[1, 3, H, W]`` float32 (normalized with the
config's data preprocessor's mean/std, printed) and gives ``seg_logits`` ``[1, C, H, W]``,
the logits at input resolution (the class map is their argmax over axis 1). The file is
written only when ONNX Runtime's run of it on a seeded input passes the check
(:func:`mita_seg.apis.export_onnx`): by default (``--check routing``) each MiTA call against
PyTorch on its own inputs, with queries at near-tied routing decisions counted and allowed to
differ (never a NaN), and end to end finite and within float32 rounding, or beyond it only
where near-ties may explain it and the graph around MiTA agrees within float32 rounding with
MiTA's node replaced by a deterministic stand-in in both (reported beside PyTorch's own noise
floor, one backend against another); ``--check strict``: end to end finite and within float32
rounding; ``--check none``: no comparison. Every file must declare the ``--opset`` asked and
pass ``onnx.checker``; ``--opset`` above what the installed onnx, onnxscript and onnxruntime
support is refused. Weights over 1.5 GiB go to ``FILE.onnx.data`` beside the file.

Usage::

    python tools/export_onnx.py CONFIG CHECKPOINT --out FILE.onnx [--shape H W]
        [--swap-attn mita] [--mita-cfg pool_size=7 topk=49 ... | --mita-plan PLAN.json]
        [--check {routing,strict,none}] [--opset 18] [--cfg-options key=value ...]

CONFIG is a file or ``mmseg::<dir>/<name>.py``; ``--swap-attn mita`` (implied by
``--mita-cfg``) puts a standard-attention model on MiTA before exporting; a MiTA config
(``configs/mita_*.py``) is exported as it is; without either, a standard model is exported
unswapped (the baseline).
"""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.cli import (DeferredHelp, KeyValueAction, add_mita_args,  # noqa: E402
                          checkpoint_file, config_file, int_range, output_file, quiet_stack,
                          run_tool, swap_settings)
from mita_seg.cli.core import ToolParser  # noqa: E402


def min_opset() -> int:
    from mita_seg.apis import MIN_OPSET
    return MIN_OPSET


def opset_help() -> str:
    from mita_seg.apis.onnx_export import OnnxExportError, max_opset
    try:
        top = f'to {max_opset()}, the highest the installed onnx, onnxscript and onnxruntime ' \
              'support'
    except OnnxExportError:     # one of them missing: the export says which
        top = 'or later'
    return f'ONNX opset, {min_opset()} {top} (default: {min_opset()})'


def parse_args(argv=None):
    parser = ToolParser(description='Export a segmentor to ONNX (MiTA as standard ONNX '
                        'operators), checked in ONNX Runtime')
    parser.add_argument('config', type=config_file,
                        help="config file or 'mmseg::<dir>/<config>.py'")
    parser.add_argument('checkpoint', type=checkpoint_file,
                        help='checkpoint (loaded strictly, weights only)')
    parser.add_argument('--out', required=True, type=output_file('--out', ('.onnx', )),
                        help='the .onnx file to write')
    parser.add_argument('--shape', type=int_range(1), nargs=2, metavar=('H', 'W'),
                        help='input height and width (default: the config\'s crop size)')
    parser.add_argument('--opset', type=int_range(1), default=None,
                        help=DeferredHelp(opset_help))
    # mita_seg.apis.onnx_export.CHECKS, spelt out: the parser is built without the stack
    parser.add_argument('--check', choices=('routing', 'strict', 'none'), default='routing',
                        help='routing (default): each MiTA call in ONNX Runtime on its own '
                        'inputs against PyTorch, queries at near-tied routing counted and '
                        'allowed to differ; end to end within float32 rounding, or beyond it '
                        'only with near-ties and the graph around MiTA within float32 rounding '
                        '(MiTA\'s node a deterministic stand-in in both); strict: end to end '
                        'within float32 rounding; none: no comparison (onnx.checker only)')
    add_mita_args(parser)
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override config settings, key=value')
    args = parser.parse_args(argv)
    args.swap = swap_settings(parser, args)
    quiet_stack()
    # checked once the paths are (the exporter's module imports the stack); a missing
    # onnx/onnxscript/onnxruntime is the export's error (exit 1), not the argument's
    if args.opset is None:
        args.opset = min_opset()
    else:
        from mita_seg.apis.onnx_export import OnnxExportError, check_opset, max_opset
        max_opset()     # onnx, onnxscript or onnxruntime missing: raised here, exit 1
        try:
            check_opset(args.opset)
        except OnnxExportError as e:
            parser.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    from mita_seg.apis import export_onnx
    r = export_onnx(args.config, args.checkpoint, args.out, args.shape, args.swap,
                    args.opset, args.cfg_options, check=args.check)
    import onnxruntime
    h, w = r.shape
    size = osp.getsize(r.path) / 2**20
    what = (f'{r.mita_layers} MiTA attention layers as standard ONNX operators'
            if r.mita_layers else 'no MiTA layer')
    data = (f', weights in {r.data} ({osp.getsize(r.data) / 2**20:.1f} MiB), keep the two '
            'together' if r.data else '')
    print(f'wrote {r.path} ({size:.1f} MiB{data}, opset {args.opset}, {what})')
    norm = (f'(img - mean) / std with mean {r.mean}, std {r.std}' if r.mean else
            'as the config\'s data preprocessor does (no mean/std in the config)')
    order = 'RGB (bgr_to_rgb=True)' if r.bgr_to_rgb else 'the image\'s own channel order'
    print(f"input  'img'        float32 [1, 3, {h}, {w}]: {norm}, channels {order}")
    print(f"output 'seg_logits' float32 [1, {r.num_classes}, {h}, {w}]: logits at input "
          'resolution; the class map is ArgMax(seg_logits, axis=1)')
    if r.check is None:
        print('not checked (--check none)')
    else:
        print(f'check ({r.check.level}) in ONNX Runtime {onnxruntime.__version__}, seeded '
              f'input: {r.check.summary()}')
    return r


if __name__ == '__main__':
    run_tool(main)
