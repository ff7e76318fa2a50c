"""May MiTA's routing GEMMs run in bf16? Issue 57's first lever moves ``S = R K^T`` and
``G = q R^T`` onto the matrix units, which read bf16; the kernel keeps them in float32
because rounding the landmarks ``R`` could move the top-k keys and the router's argmax. This
measures by how much, on trained models swapped to MiTA 7:49 without retraining, under bf16
autocast (the blocked backend, whose routing is ``mita_seg.ops.routing.mita_routing``):

  float32         : no autocast (the reference mIoU)
  bf16 R float32  : autocast, routing as the kernel computes it (float32 R)
  bf16 R bf16     : the GEMMs' input R rounded to bf16 (q and k are bf16 already), products
                    accumulated and kept in float32: a bf16 GEMM on the tiles
  bf16 R,S bf16   : also the scores S and the router logits G rounded to bf16 (top-k and
                    argmax on bf16 scores)

Per checkpoint: the mIoU of each, and for the last two, over every call of the test set, the
share of each expert's top-k keys that the float32 routing also selects and the share of
queries routed to the same expert. A measurement, not a feature: the variants are patched
into the blocked backend. See docs/benchmark.md, "May the routing GEMMs run in bf16?".

    python docs/experiments/bf16_routing.py CONFIG DATA_ROOT CKPT [CKPT ...] [--images N]
"""
import argparse
import os
from collections import defaultdict

import torch

os.environ['MITA_BACKEND'] = 'blocked'
import mita_seg.ops.blocked as blocked  # noqa: E402
from mita_seg.apis import build_runner, load_config, prepare_config, swap_model  # noqa: E402
from mita_seg.ops import routing  # noqa: E402

FLOAT32_ROUTING = routing.mita_routing
BF16 = torch.bfloat16


def rounded(x: torch.Tensor) -> torch.Tensor:
    return x.to(BF16).to(x.dtype)


def bf16_routing(round_scores: bool):
    """``mita_routing`` with R rounded to bf16 before its two GEMMs (their scales applied
    after, as a GEMM's epilogue would), and with ``round_scores`` S and G rounded too."""
    def fn(q, k, hw_shape, pool_size, topk, router_topk=1, num_prefix_tokens=1,
           shared_scale=None, landmark_bias=None):
        d = q.shape[-1]
        shared_scale = 1.0 / d if shared_scale is None else shared_scale
        R = routing.landmarks(q, hw_shape, pool_size, num_prefix_tokens)      # [B, H, M, d]
        dt, Rb = R.dtype, rounded(R)
        S = (Rb @ k.to(dt).transpose(-1, -2)) * d ** -0.5                 # [B, H, M, N]
        G = (q.to(dt) @ Rb.transpose(-1, -2)) * shared_scale             # [B, H, N, M]
        if landmark_bias is not None:
            S = S + landmark_bias[0].to(dt)
            G = G + landmark_bias[1].to(dt)
        if round_scores:
            S, G = rounded(S), rounded(G)
        keys = S.detach().topk(topk, dim=-1, sorted=False).indices        # [B, H, M, k]
        if router_topk == 1:
            choice = G.detach().argmax(dim=-1, keepdim=True)              # [B, H, N, 1]
        else:
            choice = G.detach().topk(router_topk, dim=-1, sorted=False).indices
        return routing.MiTARouting(R, S, G, keys, choice)
    return fn


class Compared:
    """A routing that also runs the float32 one on the same q, k and counts agreement."""

    def __init__(self, variant):
        self.variant, self.n = variant, defaultdict(float)

    def __call__(self, q, k, *args, **kwargs):
        assert q.dtype == BF16, f'q is {q.dtype}: the test loop ran without autocast'
        ref = FLOAT32_ROUTING(q, k, *args, **kwargs)
        out = self.variant(q, k, *args, **kwargs)
        topk = ref.expert_keys.shape[-1]
        a = torch.zeros(ref.scores.shape, dtype=torch.bool)
        b = torch.zeros(ref.scores.shape, dtype=torch.bool)
        a.scatter_(-1, ref.expert_keys, True)
        b.scatter_(-1, out.expert_keys, True)
        self.n['keys'] += (a & b).sum().item()
        self.n['keys_all'] += a.shape[:-1].numel() * topk
        self.n['same_expert'] += (ref.choice == out.choice).all(-1).sum().item()
        self.n['queries'] += ref.choice.shape[:-1].numel()
        return out

    def text(self) -> str:
        n = self.n
        return (f"top-k keys kept {100 * n['keys'] / n['keys_all']:.3f}%, "
                f"queries on the same expert {100 * n['same_expert'] / n['queries']:.3f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('config')
    ap.add_argument('data_root')
    ap.add_argument('checkpoints', nargs='+')
    ap.add_argument('--images', type=int, help='the first N validation images only')
    ap.add_argument('--setting', default='7:49', help='pool side:top-k (default 7:49)')
    args = ap.parse_args()
    torch.set_num_threads(2)
    pool, topk = (int(x) for x in args.setting.split(':'))
    opts = {'test_dataloader.dataset.data_root': args.data_root}
    if args.images:
        opts['test_dataloader.dataset.indices'] = args.images
    for ckpt in args.checkpoints:
        cfg = load_config(args.config, cfg_options=opts)
        cfg.work_dir = '/tmp/bf16_routing'
        runner = build_runner(prepare_config(cfg, checkpoint=ckpt))
        runner.load_or_resume()
        swap_model(runner.model, dict(pool_size=pool, topk=topk), verbose=False)
        print(ckpt)
        for name, fn, amp in (('float32', FLOAT32_ROUTING, False),
                              ('bf16 R float32', FLOAT32_ROUTING, True),
                              ('bf16 R bf16', Compared(bf16_routing(False)), True),
                              ('bf16 R,S bf16', Compared(bf16_routing(True)), True)):
            blocked.mita_routing = fn
            runner.test_loop.fp16 = amp   # the loop's own autocast: bf16 on CPU
            miou = runner.test()['mIoU']
            extra = fn.text() if isinstance(fn, Compared) else ''
            print(f'  {name:<15} mIoU {miou:.2f}  {extra}', flush=True)
        blocked.mita_routing = FLOAT32_ROUTING


if __name__ == '__main__':
    main()
