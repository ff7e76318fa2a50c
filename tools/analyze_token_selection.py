"""Which tokens MiTA's routed experts select, per layer: the token-pruning effect.

Loads a segmentor (standard attention checkpoints are swapped to MiTA with ``--mita-cfg``;
MiTA configs run as configured unless ``--mita-cfg`` is given), runs each image through the
config's test pipeline in whole-image mode, records for every MiTA layer and head which
tokens at least one routed expert selects, prints the per-layer fraction never selected
and writes, per image, a PNG grid of the selection maps over the network input, plus
``token_selection.json`` with the per-layer fractions.

Usage::

    python tools/analyze_token_selection.py CONFIG CHECKPOINT IMG [IMG ...] --out-dir DIR
        [--mita-cfg pool_size=7 topk=49] [--layers 0 1 ...] [--no-head]
        [--which selected|used] [--cfg-options key=value ...]
"""
import argparse
import json
import os
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mmengine.config import Config, ConfigDict, DictAction  # noqa: E402
from mmengine.dataset import Compose, pseudo_collate  # noqa: E402
from mmseg.apis import init_model  # noqa: E402

from mita_seg.analysis.token_selection import (  # noqa: E402
    TokenSelectionRecorder, plot_selection_overlay)
from mita_seg.models import MiTAAttention, swap_attention  # noqa: E402  (registers MiTA)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Record which tokens MiTA experts select')
    parser.add_argument('config', help='config file')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('images', nargs='+', help='image files')
    parser.add_argument('--out-dir', required=True, help='where to write PNGs and JSON')
    parser.add_argument('--mita-cfg', nargs='+', action=DictAction, default=None,
                        help='swap_attention settings, e.g. pool_size=7 topk=49 '
                        '(default for standard-attention models: pool_size=7 topk=49)')
    parser.add_argument('--layers', type=int, nargs='+', default=None,
                        help='backbone layers to swap (default: all)')
    parser.add_argument('--no-head', action='store_true',
                        help="do not swap Segmenter's mask head")
    parser.add_argument('--which', choices=['selected', 'used'], default='selected',
                        help='map tokens selected by any expert, or only by experts '
                        'that some query is routed to')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value')
    return parser.parse_args(argv)


def network_image(data_preprocessor, inputs: torch.Tensor) -> np.ndarray:
    """The network input ``[3, H, W]`` as a uint8 RGB image (normalisation undone)."""
    img = inputs.float()
    if getattr(data_preprocessor, '_enable_normalize', True):
        img = img * data_preprocessor.std + data_preprocessor.mean
    img = img.clamp(0, 255).byte().permute(1, 2, 0).numpy()
    if not getattr(data_preprocessor, 'channel_conversion', False):
        img = img[..., ::-1]                                # BGR as loaded -> RGB
    return np.ascontiguousarray(img)


def main(argv=None):
    args = parse_args(argv)
    missing = [p for p in args.images if not osp.isfile(p)]
    if missing:
        raise ValueError(f'image files not found: {missing}')
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    model = init_model(cfg, args.checkpoint, device='cpu')
    model.test_cfg = ConfigDict(mode='whole')   # one grid per image, aligned with the input
    has_mita = any(isinstance(m, MiTAAttention) for m in model.modules())
    if args.mita_cfg is not None or not has_mita or args.layers or args.no_head:
        mita_cfg = dict(pool_size=7, topk=49)
        mita_cfg.update(args.mita_cfg or {})
        swap_attention(model, layers=args.layers, include_head=not args.no_head, **mita_cfg)

    pipeline = Compose([t for t in cfg.test_pipeline if t['type'] != 'LoadAnnotations'])
    patch = cfg.model.backbone.get('patch_size', None)
    os.makedirs(args.out_dir, exist_ok=True)
    summary = {}
    for path in args.images:
        batch = model.data_preprocessor(pseudo_collate([pipeline(dict(img_path=path))]), False)
        with TokenSelectionRecorder(model) as recorder, torch.no_grad():
            model.predict(batch['inputs'], batch['data_samples'])
        records = [recs[0] for recs in recorder.by_layer().values()]
        image = network_image(model.data_preprocessor, batch['inputs'][0])
        name = osp.splitext(osp.basename(path))[0]
        png = plot_selection_overlay(
            image, records, osp.join(args.out_dir, f'{name}_{args.which}.png'),
            which=args.which, cell_size=(patch, patch) if patch else None,
            title=f'{name}: tokens {args.which} by MiTA routed experts '
            f'(M={records[0].num_experts}, k={records[0].topk})')
        summary[path] = {r.name: dict(hw_shape=list(r.hw_shape), num_experts=r.num_experts,
                                      topk=r.topk, never_selected=r.frac_never_selected,
                                      never_used=r.frac_never_used) for r in records}
        print(f'\n{path} ({image.shape[0]}x{image.shape[1]} input) -> {png}')
        print(f'{"layer":<28} {"grid":>7} {"M":>4} {"k":>5} {"never selected":>15} '
              f'{"never used":>11}')
        for r in records:
            print(f'{r.name:<28} {r.hw_shape[0]:>3}x{r.hw_shape[1]:<3} {r.num_experts:>4} '
                  f'{r.topk:>5} {100 * r.frac_never_selected:>14.1f}% '
                  f'{100 * r.frac_never_used:>10.1f}%')
    out_json = osp.join(args.out_dir, 'token_selection.json')
    with open(out_json, 'w') as f:
        json.dump(summary, f, indent=1)
    if len(args.images) > 1:
        print(f'\nmean over {len(args.images)} images (never selected):')
        for layer in summary[args.images[0]]:
            vals = [summary[p][layer]['never_selected'] for p in args.images]
            print(f'{layer:<28} {100 * sum(vals) / len(vals):6.1f}%')
    print(f'wrote {out_json}')
    return summary


if __name__ == '__main__':
    main()
