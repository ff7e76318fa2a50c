"""Which bias do a landmark's score and its shared logit get? Three choices, measured on a
trained tiny BEiT swapped to MiTA (M = 7x7, k = 49), blocked backend:
  mean   : the mean bias over the landmark's region (what the operator does)
  centre : the bias of the region's centre token
  none   : no bias on scores / shared logits (routed logits keep their exact bias)
Prints mIoU on the validation set and the relative error of each layer's attention output
against BEiT's dense attention on one validation image (free run, and each layer on the dense
model's own input). A measurement, not a feature: the alternatives are patched into the
blocked backend. See docs/swap.md, "Which bias does a landmark get?".

    python docs/experiments/landmark_bias_choice.py CONFIG CHECKPOINT DATA_ROOT IMAGE [SLOPES]

SLOPES (e.g. 0.1,0.4) replaces every table by ``-slope * distance`` per head.
"""
import os
import sys

import mmcv
import torch
from mmseg.apis import inference_model

os.environ['MITA_BACKEND'] = 'blocked'
import mita_seg.ops.blocked as blocked  # noqa: E402
from mita_seg.apis import build_runner, load_config, prepare_config, swap_model  # noqa: E402
from mita_seg.ops.bias import _regions, dense_bias, landmark_bias  # noqa: E402

cfg_file, ckpt, data_root, img_file = sys.argv[1:5]
torch.set_num_threads(1)


def centre_bias(bias, pool):
    (Wh, Ww), (Ph, Pw) = bias.window, pool
    r0, r1 = _regions(Wh, Ph, 'cpu')
    c0, c1 = _regions(Ww, Pw, 'cpu')
    cy, cx = (r0 + r1 - 1) // 2, (c0 + c1 - 1) // 2
    tok = 1 + (cy.view(-1, 1) * Ww + cx.view(1, -1)).reshape(-1)   # [M]
    B = dense_bias(bias)                                            # [H, N, N]
    return B[:, tok, :], B[:, :, tok]


def no_bias(bias, pool):
    Bq, Bk = landmark_bias(bias, pool)
    return torch.zeros_like(Bq), torch.zeros_like(Bk)


variants = {'mean': landmark_bias, 'centre': centre_bias, 'none': no_bias}
cfg = load_config(cfg_file, cfg_options={'test_dataloader.dataset.data_root': data_root})
cfg.work_dir = '/tmp/bias_variants'
runner = build_runner(prepare_config(cfg, checkpoint=ckpt))
runner.load_or_resume()
model = runner.model
model.cfg = cfg
model.eval()
if len(sys.argv) > 5:  # replace the tables by a locality bias of slope s per head (ALiBi-like)
    slopes = [float(x) for x in sys.argv[5].split(',')]
    for mod in model.modules():
        if type(mod).__name__ == 'BEiTAttention':
            Wh, Ww = mod.window_size
            dy = torch.arange(-(Wh - 1), Wh).view(-1, 1).float()
            dx = torch.arange(-(Ww - 1), Ww).view(1, -1).float()
            dist = (dy ** 2 + dx ** 2).sqrt().reshape(-1)
            with torch.no_grad():
                for h in range(mod.num_heads):
                    mod.relative_position_bias_table[:-3, h] = -slopes[h % len(slopes)] * dist
                mod.relative_position_bias_table[-3:] = 0
    print('tables replaced by -s * distance, s =', slopes)
img = mmcv.imread(img_file)
names = [n for n, m in model.named_modules() if type(m).__name__ == 'BEiTAttention']
inputs = {}


def record(m):
    out = {}

    def hook(mod, args, output, name):
        out[name] = output
        inputs.setdefault(name, args[0])

    hs = [mod.register_forward_hook(lambda mod, a, o, n=n: hook(mod, a, o, n))
          for n, mod in m.named_modules() if n in names]
    inference_model(m, img)
    for h in hs:
        h.remove()
    return out


ref = record(model)
print('dense    mIoU %.2f' % runner.test()['mIoU'])
swap_model(model, dict(pool_size=7, topk=49), verbose=False)
for name, fn in variants.items():
    blocked.landmark_bias = fn
    out = record(model)
    err = ' '.join('%.3f' % ((out[n] - ref[n]).norm() / ref[n].norm()) for n in names)
    mods = dict(model.named_modules())
    with torch.no_grad():  # each layer on the dense model's input: errors that do not compound
        tf = ' '.join('%.3f' % ((mods[n](inputs[n]) - ref[n]).norm() / ref[n].norm())
                      for n in names)
    print('%-8s mIoU %.2f   per-layer rel. error: free run %s, on the dense inputs %s'
          % (name, runner.test()['mIoU'], err, tf))
