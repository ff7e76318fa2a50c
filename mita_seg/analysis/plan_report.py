"""A swap plan (:class:`~mita_seg.models.plan.SwapPlan`) chosen by calibration
(:func:`mita_seg.apis.calibrate_swap`), in words: each layer's setting, error and cost, then
the totals, as ``tools/calibrate_swap.py`` prints it."""
from mita_seg.setting import label

__all__ = ['format_plan']


def format_plan(plan) -> str:
    """The plan as a short table: each layer's choice, error and GFLOPs, then the totals."""
    info, per_layer = plan.info, plan.info['layer_info']
    width = max(len(n) for n in plan.layers) + 2
    lines = [f'{"layer":<{width}}{"setting":<24}{"error (KL)":>12}{"GFLOPs":>10}']
    for name, setting in plan.layers.items():
        li = per_layer[name]
        lines.append(f'{name:<{width}}{label(setting):<24}{li["error"]:12.4g}'
                     f'{li["gflops"]:10.4g}')
    f, b, c = info['flops'], info['budget'], info['calibration']
    asked = f' (uniform {b["uniform"]})' if b.get('uniform') else ''
    lines.append(f'plan: {f["plan_gflops"]:.4g} GFLOPs, {f["reduction_percent"]:.1f}% below dense '
                 f'{f["dense_gflops"]:.4g} (budget {b["gflops"]:.4g}{asked}; {b["counted"]})')
    against = (f', uniform {b["uniform"]}: {b["uniform_predicted_error"]:.4g}'
               if b.get('uniform') else '')
    lines.append(f'{plan.summary()}; predicted error {c["predicted_error"]:.4g}{against} (sum '
                 'of the layers\' errors)')
    lines.append(f'calibration: {len(c["images"])} training images, {len(c["candidates"])} '
                 f'candidates, {c["image_forwards"]} image forwards, {c["seconds"]:.0f}s')
    return '\n'.join(lines)
