"""Segment one image and draw the result, as mmseg's ``demo/image_demo.py``, optionally with
the model's attention swapped to MiTA.

Usage::

    python tools/image_demo.py IMG CONFIG CHECKPOINT --out-file OUT.png
        [--swap-attn mita] [--mita-cfg pool_size=7 topk=49 ... | --mita-plan PLAN.json]
        [--device cpu]
        [--opacity 0.5] [--title TITLE] [--cfg-options key=value ...]

CONFIG is a file or ``mmseg::<dir>/<name>.py``; the checkpoint must fit the model exactly
(:func:`mita_seg.apis.init_model`). Prints the classes found, by share of the pixels.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmengine.config import DictAction  # noqa: E402

from mita_seg.apis import (add_mita_args, inference_model, init_model, run_tool,  # noqa: E402
                           show_result_pyplot, swap_settings)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Segment one image')
    parser.add_argument('img', help='image file')
    parser.add_argument('config', help="config file, or 'mmseg::<dir>/<config>.py'")
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--out-file', required=True, help='where to write the drawing (PNG)')
    add_mita_args(parser)
    parser.add_argument('--device', default='cpu', help='device, e.g. cpu or cuda:0')
    parser.add_argument('--opacity', type=float, default=0.5,
                        help='opacity of the painted segmentation, in (0, 1]')
    parser.add_argument('--title', default='result', help='title of the drawing')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value')
    args = parser.parse_args(argv)
    args.mita = swap_settings(parser, args)
    if not osp.isfile(args.img):
        parser.error(f'image {args.img} not found')
    if not 0 < args.opacity <= 1:
        parser.error(f'--opacity must be in (0, 1], got {args.opacity}')
    return args


def main(argv=None):
    args = parse_args(argv)
    model = init_model(args.config, args.checkpoint, args.device, args.cfg_options, args.mita)
    result = inference_model(model, args.img)
    show_result_pyplot(model, args.img, result, opacity=args.opacity, title=args.title,
                       draw_gt=False, show=False, out_file=args.out_file)
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
