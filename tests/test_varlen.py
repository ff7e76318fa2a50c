"""The varlen backend (one softmax per expert group) against the dense reference, on CPU.

The packing is shared by the three kernels (FlashAttention-2 varlen on CUDA fp16/bf16,
nested-jagged SDPA on CUDA otherwise, padded batched SDPA on CPU), so these tests prove it
on CPU through the padded kernel and through nested-jagged SDPA; CUDA-only cases are skipped
without a GPU.
"""
import pytest
import torch
import torch.nn.functional as F

from mita_seg.ops import (AUTO_ORDER, BACKENDS, Inputs, mita_attention,
                          mita_attention_reference, mita_routing, select_backend)
from mita_seg.ops.routing import landmarks
from mita_seg.ops.varlen import attend, kernel, mita_attention_varlen, pack

# (B, H, h, w, prefix, suffix, d, pool, topk): awkward sizes on purpose (router top-1).
CASES = {
    'vit-7x11-cls': (2, 3, 7, 11, 1, 0, 16, (3, 3), 10),
    '32x43-cls': (1, 2, 32, 43, 1, 0, 8, (7, 7), 49),
    '32x43-suffix150': (1, 2, 32, 43, 0, 150, 8, (5, 7), 49),
    '5x5-odd-d-batch3': (3, 1, 5, 5, 2, 3, 5, (2, 3), 4),
    '1x9-pool1': (1, 2, 1, 9, 1, 0, 4, (1, 2), 3),
}
KERNELS = ['padded', 'nested']
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')


def _qkv(B, H, N, d, dtype=torch.float32, seed=0, device='cpu'):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g).to(device, dtype).requires_grad_()
            for _ in range(4)]


def _kw(case, shared):
    B, H, h, w, p, s, d, pool, topk = case
    return dict(hw_shape=(h, w), pool_size=pool, topk=topk, num_prefix_tokens=p,
                with_shared_expert=shared)


@pytest.mark.parametrize('kernel_name', KERNELS)
@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'route-only'])
@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_outputs_and_gradients_match_reference(case, shared, kernel_name):
    B, H, h, w, p, s, d, pool, topk = case
    q, k, v, g = _qkv(B, H, p + h * w + s, d)
    kw = _kw(case, shared)
    out = mita_attention_varlen(Inputs(q, k, v, **kw), kernel_name=kernel_name)
    ref = mita_attention_reference(Inputs(q, k, v, **kw))
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip('qkv', grads, grads_ref):
        assert b.abs().sum() > 0, f'd{name} of the reference is zero: the case tests nothing'
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f'd{name}: {m}')


@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_public_op_forced_to_varlen(case):
    B, H, h, w, p, s, d, pool, topk = case
    q, k, v, _ = _qkv(B, H, p + h * w + s, d, seed=1)
    kw = _kw(case, True)
    with torch.no_grad():   # the opaque custom op
        out = mita_attention(q, k, v, backend='varlen', **kw)
    torch.testing.assert_close(out, mita_attention_reference(Inputs(q, k, v, **kw)),
                               atol=1e-5, rtol=1e-5)


def test_packing_layout():
    B, H, h, w, d, (ph, pw), topk = 2, 3, 6, 7, 8, (2, 3), 5
    N, M = 1 + h * w, ph * pw
    q, k, v, _ = _qkv(B, H, N, d, seed=2)
    rt = mita_routing(q, k, (h, w), (ph, pw), topk)
    R = landmarks(q, (h, w), (ph, pw), 1)
    p = pack(q, k, v, R, R, rt.expert_keys, rt.choice, 1.0)
    counts = torch.bincount((torch.arange(B * H).unsqueeze(1) * M +
                             rt.choice.reshape(B * H, N)).reshape(-1), minlength=B * H * M)
    live = counts[counts > 0]
    G = live.numel()
    # the layout varlen_attn takes: int32 offsets from 0, keys in multiples of M + k
    assert p.cu_seq_q.dtype == p.cu_seq_k.dtype == torch.int32
    assert p.cu_seq_q.tolist() == [0] + live.cumsum(0).tolist()
    assert p.cu_seq_k.tolist() == [(M + topk) * i for i in range(G + 1)]
    assert p.max_q == live.max().item() and p.kv_len == M + topk
    assert p.q.shape == (B * H * N, d) and p.k.shape == p.v.shape == (G * (M + topk), d)
    # a permutation of the queries, grouped by expert, token order kept within a group
    assert torch.equal(p.order.sort().values, torch.arange(B * H * N))
    assert torch.equal(p.order[p.inverse], torch.arange(B * H * N))
    torch.testing.assert_close(p.q, q.reshape(-1, d)[p.order])
    grp = torch.repeat_interleave(torch.arange(G), live)
    assert (p.order.diff()[grp[1:] == grp[:-1]] > 0).all()
    # the first group's keys: the landmarks, then its expert's keys
    bh0, e0 = divmod(int(counts.nonzero()[0]), M)
    torch.testing.assert_close(p.k[:M], R.reshape(B * H, M, d)[bh0])
    torch.testing.assert_close(p.k[M:M + topk], k.reshape(B * H, N, d)[bh0][
        rt.expert_keys.reshape(B * H, M, topk)[bh0, e0]])


def test_experts_with_no_query_are_dropped():
    # Queries built so that every query prefers the landmark of the left half of the grid:
    # the right half's experts get no query, and their groups must not appear.
    B, H, h, w, d = 1, 1, 4, 8, 4
    N = h * w
    q = torch.zeros(B, H, N, d)
    grid = q[0, 0].view(h, w, d)
    grid[:, :4, 0] = 1.0                        # left half points along e0
    grid[:, 4:, 0] = 0.25                       # right half weaker along e0
    q += 0.01 * torch.randn(B, H, N, d, generator=torch.Generator().manual_seed(3))
    k, v = (torch.randn(B, H, N, d, generator=torch.Generator().manual_seed(s)) for s in (4, 5))
    kw = dict(hw_shape=(h, w), pool_size=(1, 2), topk=6, num_prefix_tokens=0)
    rt = mita_routing(q, k, (h, w), (1, 2), 6, num_prefix_tokens=0)
    assert rt.choice.unique().tolist() == [0], 'the case must leave expert 1 empty'
    R = landmarks(q, (h, w), (1, 2), 0)
    p = pack(q, k, v, R, R, rt.expert_keys, rt.choice, 1.0)
    assert p.cu_seq_q.tolist() == [0, N]
    for kernel_name in KERNELS:
        out = mita_attention_varlen(Inputs(q, k, v, **kw), kernel_name=kernel_name)
        torch.testing.assert_close(out, mita_attention_reference(Inputs(q, k, v, **kw)),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('prefix,suffix', [(0, 0), (1, 0), (1, 7)])
def test_route_only_full_topk_equals_sdpa(prefix, suffix):
    h, w = 6, 9
    q, k, v, g = _qkv(2, 3, prefix + h * w + suffix, 16, seed=6)
    N = q.shape[2]
    out = mita_attention(q, k, v, hw_shape=(h, w), pool_size=3, topk=N,
                         num_prefix_tokens=prefix, with_shared_expert=False, backend='varlen')
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('shared_scale', [0.05, 1.0])
def test_shared_scale(shared_scale):
    q, k, v, _ = _qkv(2, 2, 1 + 8 * 9, 16, seed=7)
    kw = dict(hw_shape=(8, 9), pool_size=3, topk=12, shared_scale=shared_scale)
    out = mita_attention(q, k, v, backend='varlen', **kw)
    ref = mita_attention_reference(Inputs(q, k, v, **{**kw, 'pool_size': (3, 3)}))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_low_precision_routes_like_float32(dtype):
    # Routing runs in float32: the experts and keys chosen for the rounded inputs are those
    # of the float32 reference on the same values, and the result is close to it.
    q, k, v, _ = _qkv(2, 2, 1 + 10 * 10, 32, dtype=dtype, seed=8)
    kw = dict(hw_shape=(10, 10), pool_size=(4, 4), topk=20)
    out = mita_attention(q, k, v, backend='varlen', **kw)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = mita_attention_reference(Inputs(*(t.detach().float() for t in (q, k, v)), **kw))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_gradcheck_float64():
    q, k, v, _ = (t.detach().double().requires_grad_() for t in _qkv(1, 2, 1 + 12, 3, seed=9))
    for shared in (True, False):
        kw = dict(hw_shape=(3, 4), pool_size=2, topk=4, with_shared_expert=shared,
                  backend='varlen')
        assert torch.autograd.gradcheck(lambda a, b, c: mita_attention(a, b, c, **kw),
                                        (q, k, v))


def test_router_top2_is_refused_with_the_reason_and_falls_back():
    q, k, v, _ = _qkv(1, 2, 1 + 36, 8, seed=10)
    kw = dict(hw_shape=(6, 6), pool_size=2, topk=5, router_topk=2)
    # forced: the reason names the argument
    with pytest.raises(ValueError, match='router_topk=2'):
        mita_attention(q, k, v, backend='varlen', **kw)
    # automatic on CUDA: varlen first, then blocked, which runs what varlen cannot
    inp = Inputs(q, k, v, (6, 6), (2, 2), 5, router_topk=2)
    assert AUTO_ORDER['cuda'] == ('varlen', 'blocked')
    assert BACKENDS['varlen'].unsupported(inp) and not BACKENDS['blocked'].unsupported(inp)


def test_cpu_kernel_choice():
    q, k, v, _ = _qkv(1, 1, 1 + 16, 8)
    p = pack(q, k, v, None, None, torch.zeros(1, 1, 4, 3, dtype=torch.long),
             torch.zeros(1, 1, 17, 1, dtype=torch.long), 1.0)
    assert kernel(p) == 'padded'
    with pytest.raises(ValueError, match='unknown varlen kernel'):
        attend(p, 'magic')


@pytest.mark.parametrize('mode', ['train', 'eval'])
def test_torch_compile_of_the_module(mode):
    pytest.importorskip('mmseg')  # scripts/gpu_check.sh runs this file without mmseg
    from mita_seg.models import MiTAAttention
    torch.manual_seed(0)
    attn = MiTAAttention(32, 4, pool_size=3, topk=8).train(mode == 'train')
    x = torch.randn(2, 1 + 6 * 7, 32, requires_grad=mode == 'train')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('MITA_BACKEND', 'varlen')
        compiled = torch.compile(attn, backend='eager')
        out = compiled(x, hw_shape=(6, 7))
        ref = attn(x, hw_shape=(6, 7))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('MITA_BACKEND', 'reference')
        dense = attn(x, hw_shape=(6, 7))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    if mode == 'train':
        out.sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attn.parameters())


@cuda
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize('case', list(CASES.values())[:3], ids=list(CASES)[:3])
def test_cuda_kernels_match_reference(case, dtype):
    B, H, h, w, p, s, d, pool, topk = case
    q, k, v, g = _qkv(B, H, p + h * w + s, d, dtype=dtype, device='cuda')
    kw = _kw(case, True)
    x = Inputs(q, k, v, (h, w), pool, topk)
    assert select_backend(x) == 'varlen'
    out = mita_attention(q, k, v, **kw)
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = mita_attention_reference(Inputs(*fp32, **kw))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(grads, torch.autograd.grad(ref, fp32, g.float())):
        torch.testing.assert_close(a.float(), b, atol=10 * tol, rtol=10 * tol)


def test_segmenter_vit_t_trains_a_step_and_evaluates_on_varlen(monkeypatch):
    # mmseg's Segmenter ViT-T with MiTA in the backbone and the mask head (the config of
    # configs/), shrunk to 2 encoder layers and 112x112 crops (a 7x7 grid: the published
    # 7x7 pool just fits).
    pytest.importorskip('mmseg')
    import os.path as osp

    from mmengine.config import Config
    from mmengine.optim import OptimWrapper
    from mmengine.registry import init_default_scope
    from mmengine.structures import PixelData
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample

    import mita_seg.models  # noqa: F401

    root = osp.dirname(osp.dirname(osp.abspath(__file__)))
    cfg = Config.fromfile(osp.join(root, 'configs',
                                   'mita_segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'))
    crop = (112, 112)
    cfg.model.backbone.update(num_layers=2, img_size=crop, init_cfg=None)
    cfg.model.pretrained = None
    cfg.model.data_preprocessor.size = crop
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    g = torch.Generator().manual_seed(0)
    inputs, samples = [], []
    for _ in range(2):
        inputs.append(torch.randint(0, 256, (3, *crop), generator=g, dtype=torch.uint8))
        sample = SegDataSample(gt_sem_seg=PixelData(data=torch.randint(0, 150, (1, *crop),
                                                                       generator=g)))
        sample.set_metainfo(dict(img_shape=crop, ori_shape=crop, pad_shape=crop))
        samples.append(sample)

    def evaluate(backend):
        monkeypatch.setenv('MITA_BACKEND', backend)
        model.eval()
        return [p.seg_logits.data for p in model.test_step(dict(inputs=inputs,
                                                                data_samples=samples))]

    # Evaluation on varlen equals the dense reference (before training: afterwards one
    # SGD step of lr 0.1 leaves near-ties in the routing of the deeper layers, where any
    # two implementations may differ by rounding).
    for a, b in zip(evaluate('varlen'), evaluate('reference')):
        assert a.shape == (150, *crop)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

    monkeypatch.setenv('MITA_BACKEND', 'varlen')
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    model.train()
    losses = model.train_step(dict(inputs=inputs, data_samples=samples), optim)
    assert all(torch.isfinite(v) for v in losses.values())
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before), 'every parameter takes a step'
    assert all(torch.isfinite(a).all() for a in evaluate('varlen'))
