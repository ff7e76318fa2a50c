"""Segment one image and draw the result, as mmseg's ``demo/image_demo.py``, optionally with
the model's attention swapped to MiTA.

Usage::

    python tools/image_demo.py IMG CONFIG CHECKPOINT --out-file OUT.png
        [--swap-attn mita] [--mita-cfg pool_size=7 topk=49 ... | --mita-plan PLAN.json]
        [--device cuda:0] [--opacity 0.5] [--with-labels] [--title TITLE]
        [--cfg-options key=value ...]

mmseg's arguments mean what they mean there (``--device`` defaults to ``cuda:0`` where CUDA
is, else ``cpu``; ``--with-labels`` names the classes on the drawing), except that
``--out-file`` is needed (this tool opens no window) and ``--title`` is drawn in a band above
the image.

CONFIG is a file or ``mmseg::<dir>/<name>.py``; the checkpoint must fit the model exactly
(:func:`mita_seg.apis.init_model`). Prints the classes found, by share of the pixels.
"""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.cli import (KeyValueAction, add_mita_args, checkpoint_file, config_file,  # noqa: E402
                          device_name, ensure_parent, float_range, image_file, output_file,
                          quiet_stack, run_tool, swap_settings)
from mita_seg.cli.core import ToolParser  # noqa: E402


def parse_args(argv=None):
    parser = ToolParser(description='Segment one image')
    parser.add_argument('img', type=image_file, help='image file')
    parser.add_argument('config', type=config_file,
                        help="config file, or 'mmseg::<dir>/<config>.py'")
    parser.add_argument('checkpoint', type=checkpoint_file, help='checkpoint file')
    parser.add_argument('--out-file', type=output_file('--out-file', ('.png', '.jpg', '.jpeg',
                                                                      '.bmp')),
                        help='where to write the drawing (PNG or JPEG; its folder is made if '
                        "missing); needed: this tool opens no window, as mmseg's does without it")
    add_mita_args(parser)
    parser.add_argument('--device', type=device_name, default=None,
                        help="device, e.g. cpu or cuda:0 (default: mmseg's cuda:0 where CUDA "
                        'is available, else cpu)')
    parser.add_argument('--opacity', type=float_range(0, 1, low_open=True), default=0.5,
                        help='opacity of the painted segmentation, in (0, 1]')
    parser.add_argument('--with-labels', action='store_true',
                        help="write the class names on the drawing (mmseg's --with-labels)")
    parser.add_argument('--title', help='a title drawn above the image (default: none)')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override config settings, key=value')
    args = parser.parse_args(argv)
    if args.out_file is None:
        parser.error("--out-file OUT.png is needed: this tool writes the drawing to a file and "
                     "opens no window (mmseg's demo/image_demo.py shows one without --out-file)")
    args.mita = swap_settings(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.apis import inference_model, init_model, show_result_pyplot
    from mita_seg.apis.inference import draw_title
    if args.device is None:     # mmseg's default, where there is CUDA
        import torch
        args.device = 'cuda:0' if torch.cuda.is_available() else 'cpu'
    model = init_model(args.config, args.checkpoint, args.device, args.cfg_options, args.mita)
    result = inference_model(model, args.img)
    drawn = show_result_pyplot(model, args.img, result, opacity=args.opacity,
                               title=args.title or 'result', draw_gt=False, show=False,
                               with_labels=args.with_labels)
    if args.title:
        drawn = draw_title(drawn, args.title)
    from mita_seg.utils.atomic_files import atomic_write_image
    # whole: encoded, then written to a temporary file beside it that replaces it in one rename
    atomic_write_image(drawn[..., ::-1], ensure_parent(args.out_file))   # RGB -> BGR
    pred = result.pred_sem_seg.data[0]
    ids, counts = pred.flatten().unique(return_counts=True)
    classes = model.dataset_meta['classes']
    found = sorted(zip(counts.tolist(), ids.tolist()), reverse=True)
    shares = [f'{classes[i].strip()} {100 * n / pred.numel():.1f}%' for n, i in found]
    print(f'wrote {args.out_file}: {pred.shape[0]}x{pred.shape[1]}, {len(found)} classes: '
          + ', '.join(shares[:8]) + (' ...' if len(found) > 8 else ''))
    return result


if __name__ == '__main__':
    run_tool(main)
