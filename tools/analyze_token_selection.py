"""Which tokens MiTA's routed experts select, per layer: the token-pruning effect.

Loads a segmentor (strictly, weights-only; a standard-attention model is swapped to MiTA,
with ``--mita-cfg`` or the defaults; a MiTA model runs as configured unless ``--mita-cfg``
is given), runs each image through the config's test pipeline in whole-image mode, records
for every MiTA layer which tokens at least one routed expert selects
(:mod:`mita_seg.analysis.token_selection`), prints the per-layer fraction never selected and
writes, per image, a PNG grid of the selection maps over the network input, plus
``token_selection.json`` with the per-layer fractions.

Usage::

    python tools/analyze_token_selection.py CONFIG CHECKPOINT IMG [IMG ...] --out-dir DIR
        [--mita-cfg pool_size=7 topk=49 layers=[0,1] include_head=True]
        [--which selected|used] [--cfg-options key=value ...]
"""
import json
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.cli import (KeyValueAction, add_mita_args, checkpoint_file, config_file,  # noqa: E402
                          image_file, output_dir, quiet_stack, run_tool, swap_settings)
from mita_seg.cli.core import ToolParser  # noqa: E402


def parse_args(argv=None):
    parser = ToolParser(description='Record which tokens MiTA experts select')
    parser.add_argument('config', type=config_file,
                        help="config file, or 'mmseg::<dir>/<config>.py'")
    parser.add_argument('checkpoint', type=checkpoint_file, help='checkpoint file')
    parser.add_argument('images', type=image_file, nargs='+', help='image files')
    parser.add_argument('--out-dir', type=output_dir('--out-dir'), required=True,
                        help='where to write PNGs and JSON (made if missing)')
    add_mita_args(parser, swap_flag=False)
    parser.add_argument('--which', choices=['selected', 'used'], default='selected',
                        help='map tokens selected by any expert, or only by experts '
                        'that some query is routed to')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override config settings, key=value')
    args = parser.parse_args(argv)
    args.mita = swap_settings(parser, args)
    setting = (args.mita or {}).get('setting')
    if setting is not None and not setting.is_mita:
        parser.error(f'--swap-attn {setting.text}: token selection maps MiTA\'s experts; '
                     f'{setting.kind} attention has none: give a MiTA setting such as 7:49')
    # one PNG per image, named by its file name: two images of one name would share it
    drawn = {}
    for path in args.images:
        png = png_name(path, args.which)
        if png in drawn:
            parser.error(f'images {drawn[png]!r} and {path!r} would both be drawn to '
                         f'{osp.join(args.out_dir, png)}: give each image once, under a '
                         'file name of its own')
        drawn[png] = path
    return args


def png_name(image: str, which: str) -> str:
    """The file name of ``image``'s selection maps in the output folder."""
    return f'{osp.splitext(osp.basename(image))[0]}_{which}.png'


def main(argv=None):
    args = parse_args(argv)
    quiet_stack()
    from mmengine.config import ConfigDict

    from mita_seg.analysis.token_selection import (experts_label, plot_selection_overlay,
                                                   record_image)
    from mita_seg.apis import init_model
    from mita_seg.utils.atomic_files import atomic_write_text
    # a MiTA model keeps the settings --mita-cfg does not give; others get the defaults
    model = init_model(args.config, args.checkpoint, cfg_options=args.cfg_options,
                       mita_cfg=args.mita)
    model.test_cfg = ConfigDict(mode='whole')   # one grid per image, aligned with the input
    patch = model.cfg.model.backbone.get('patch_size', None)
    # every image is run before anything is written (no half-written output)
    runs = [(path, *record_image(model, path)) for path in args.images]
    summary = {}
    for path, records, image in runs:
        name = osp.splitext(osp.basename(path))[0]
        png = plot_selection_overlay(   # each file whole (its folder made)
            image, records, osp.join(args.out_dir, png_name(path, args.which)),
            which=args.which, cell_size=(patch, patch) if patch else None,
            title=f'{name}: tokens {args.which} by MiTA routed experts '
            f'({experts_label(records)})')
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
    atomic_write_text(json.dumps(summary, indent=1) + '\n', out_json)
    if len(args.images) > 1:
        print(f'\nmean over {len(args.images)} images (never selected):')
        for layer in summary[args.images[0]]:
            vals = [summary[p][layer]['never_selected'] for p in args.images]
            print(f'{layer:<28} {100 * sum(vals) / len(vals):6.1f}%')
    print(f'wrote {out_json}')
    return summary


if __name__ == '__main__':
    run_tool(main)
