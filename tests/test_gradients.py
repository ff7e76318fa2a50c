"""Every parameter learns: MiTA's top-k and argmax cut no gradient path that softmax
attention has, apart from the routing decision itself.

Model level: one training step (the real ``model.loss`` through the data preprocessor) of the
model of every config in ``configs/``, shrunk (fewer encoder layers, 112x112 crops, seeded
random weights); every parameter with ``requires_grad`` must get a non-zero gradient.
Operator level: gradients reach every query, key and value that the maths says they reach.
"""
import glob
import os.path as osp

import pytest
import torch

from mita_seg.ops import mita_attention, mita_routing

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', '*.py')))
CROP = (112, 112)  # a 7x7 grid at patch 16: the published pool of 7x7 just fits


def _shrink(cfg):
    """Fewer encoder layers and small crops; the architecture is otherwise the config's."""
    backbone = cfg.model.backbone
    outs = backbone.get('out_indices', -1)
    if isinstance(outs, (list, tuple)) and len(outs) > 1:  # UperNet: one output per layer
        backbone.num_layers = len(outs)
        backbone.out_indices = tuple(range(len(outs)))
    else:  # Segmenter: the last layer only
        backbone.num_layers = 2
    backbone.img_size = CROP
    backbone.pretrained = None
    backbone.init_cfg = None
    cfg.model.pretrained = None
    cfg.model.data_preprocessor.size = CROP
    # SyncBN needs a process group; BN has the same parameters
    for head in ('decode_head', 'auxiliary_head', 'neck'):
        part = cfg.model.get(head)
        if isinstance(part, dict) and part.get('norm_cfg', {}).get('type') == 'SyncBN':
            part.norm_cfg = dict(type='BN', requires_grad=True)
    return cfg


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.splitext(osp.basename(p))[0])
def test_every_parameter_gets_a_gradient(path):
    pytest.importorskip('mmseg')
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.structures import PixelData
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample

    import mita_seg.models  # noqa: F401

    cfg = _shrink(Config.fromfile(path))
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    model.train()
    num_classes = cfg.model.decode_head.num_classes
    g = torch.Generator().manual_seed(0)
    inputs, samples = [], []
    for _ in range(2):
        inputs.append(torch.randint(0, 256, (3, *CROP), generator=g, dtype=torch.uint8))
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(
            data=torch.randint(0, num_classes, (1, *CROP), generator=g))
        sample.set_metainfo(dict(img_shape=CROP, ori_shape=CROP, pad_shape=CROP))
        samples.append(sample)
    data = model.data_preprocessor(dict(inputs=inputs, data_samples=samples), training=True)
    losses = model(**data, mode='loss')
    loss, _ = model.parse_losses(losses)
    assert torch.isfinite(loss)
    loss.backward()

    no_grad = [n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    # No exceptions are needed: with random labels over all classes every classifier row
    # gets a gradient, the cls token is a key/value of every query (shared expert) and the
    # auxiliary head has its own loss.
    assert not no_grad, f'parameters without gradient: {no_grad}'


# name: (B, H, h, w, prefix, suffix, d, pool, topk, router_topk)
OP_CASES = {
    'vit-cls': (2, 2, 7, 9, 1, 0, 8, 3, 6, 1),
    'suffix-r2': (1, 3, 6, 6, 0, 5, 5, 2, 4, 2),
}


@pytest.mark.parametrize('case', list(OP_CASES.values()), ids=list(OP_CASES))
def test_shared_expert_gives_every_token_gradients(case):
    # With the shared expert every key and value is in softmax(S / sqrt(d)) V, and every
    # query feeds its own logits and the landmarks: dq, dk, dv are non-zero for every token.
    B, H, h, w, p, s, d, pool, topk, r = case
    N = p + h * w + s
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    out = mita_attention(q, k, v, hw_shape=(h, w), pool_size=pool, topk=topk, router_topk=r,
                         num_prefix_tokens=p)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g,
                                                                 dtype=out.dtype))
    for name, grad in zip('qkv', (dq, dk, dv)):
        per_token = grad.abs().sum(-1)  # [B, H, N]
        assert (per_token > 0).all(), f'd{name} is zero for some tokens'


@pytest.mark.parametrize('case', list(OP_CASES.values()), ids=list(OP_CASES))
def test_route_only_gradients_reach_exactly_the_selected_keys(case):
    # Route-only MiTA: a key/value gets a gradient iff some query reads the expert holding it
    # (the routing decision itself carries no gradient). Every query gets a gradient.
    B, H, h, w, p, s, d, pool, topk, r = case
    N = p + h * w + s
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    kw = dict(hw_shape=(h, w), pool_size=(pool, pool), topk=topk, router_topk=r,
              num_prefix_tokens=p)
    out = mita_attention(q, k, v, with_shared_expert=False, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g,
                                                                 dtype=out.dtype))
    rt = mita_routing(q.detach(), k.detach(), **kw)
    M = rt.expert_keys.shape[2]
    used = torch.zeros(B, H, M, dtype=torch.bool)
    used.scatter_(2, rt.choice.reshape(B, H, -1), True)                 # experts read
    read = torch.zeros(B, H, N, dtype=torch.bool)
    keys = rt.expert_keys.masked_fill(~used.unsqueeze(-1), N)            # N = "no key"
    read = torch.cat([read, read[..., :1]], -1).scatter_(2, keys.reshape(B, H, -1), True)
    read = read[..., :N]
    assert (dq.abs().sum(-1) > 0).all()
    assert torch.equal(dv.abs().sum(-1) > 0, read)
    assert torch.equal(dk.abs().sum(-1) > 0, read)
