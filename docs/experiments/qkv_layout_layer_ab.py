"""One ViT-B MiTA attention layer (issue 57) at N = 4097 (64x64 grid + cls), batch 1, no_grad,
2 threads: the module as it is in the checkout ROOT (q, k, v read in place from the qkv
projection, the output written as [B, N, C]), interleaved with the layout before emulated on
the same kernel (q, k, v copied to [BH, N, d], the output [BH, N, d] transposed to [B, N, C])
and with the bound (``out = v``, the projections kept). ``python
docs/experiments/qkv_layout_layer_ab.py ROOT``; its output of 2026-12-06 is in
docs/benchmark/2026-12-06_zen3_qkv_layout.txt."""
import sys

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mita_seg.analysis.timing import interleaved_medians  # noqa: E402
from mita_seg.models.attention import MiTAAttention  # noqa: E402
from mita_seg.ops.fused_cpu import _C  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
C, H, s = 768, 12, 64
N, d = 1 + s * s, C // H
m = MiTAAttention(C, H, pool_size=7, topk=49).eval()
x = torch.randn(1, N, C)


def new():
    return m(x, hw_shape=(s, s))


def old():
    B = 1
    qkv = F.linear(x, m.attn.in_proj_weight, m.attn.in_proj_bias)
    q, k, v = qkv.reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    qb, kb, vb = (t.reshape(B * H, N, d).contiguous() for t in (q, k, v))  # copies
    out = _C.mita_forward(qb, kb, vb, s, s, 7, 7, 1, 49, 1, True, 1.0 / d, False,
                          None, None, None, 0, 0)[0]
    y = out.view(B, H, N, d).transpose(1, 2).reshape(B, N, C)   # copy
    return x + m.attn.out_proj(y)


def bound():
    qkv = F.linear(x, m.attn.in_proj_weight, m.attn.in_proj_bias)
    return x + m.attn.out_proj(qkv[..., 2 * C:])


with torch.no_grad():
    a, b = new(), old()
    print('max |new - old|', (a - b).abs().max().item(), flush=True)
    t_new, t_old, t_bound = interleaved_medians([new, old, bound], 3.0, rounds=15)
print(f'layer ms: new {1e3*t_new:.2f}  old {1e3*t_old:.2f}  bound {1e3*t_bound:.2f}  '
      f'attention over the bound: new {1e3*(t_new-t_bound):.2f} old {1e3*(t_old-t_bound):.2f}')
