"""``torch.compile`` of swapped models: one graph, no graph break (the MiTA operator is a
``torch.library`` custom op with fake implementations, forward and backward, so it needs
none either), the same results as eager; and MMEngine's ``compile`` trains a MiTA config
(:class:`~mita_seg.engine.PlainParamGroupsHook`). Inductor's C++ compile takes minutes on a
loaded 2-core host: those tests are ``slow``; the graph-break counts and the training graph
(``aot_eager``: aot_autograd, the custom ops' fakes and backward, without the C++ compile)
run in the fast subset."""
import os.path as osp

import pytest
import torch
import torch._dynamo as dynamo

from mita_seg.apis import build_runner, init_model, load_config, prepare_config
from mita_seg.models import FastMultiheadAttention, MiTAAttention

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY_UPERNET = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')
VIT_T = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
# mmseg's Segmenter ViT-T narrowed (2 layers of 64, patch 8, 1 mask-head layer, 10
# classes), no stochastic depth (compiled dropout draws other random numbers)
TINY = {'model.backbone.embed_dims': 64, 'model.backbone.num_layers': 2,
        'model.backbone.num_heads': 4, 'model.backbone.patch_size': 8,
        'model.backbone.img_size': (64, 64), 'model.backbone.init_cfg': None,
        'model.backbone.drop_path_rate': 0.0, 'model.decode_head.in_channels': 64,
        'model.decode_head.channels': 64, 'model.decode_head.embed_dims': 64,
        'model.decode_head.num_heads': 4, 'model.decode_head.num_layers': 1,
        'model.decode_head.num_classes': 10}


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path, monkeypatch):
    """One thread; compiled code of this test only (no other process's inductor cache)."""
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path / 'inductor'))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dynamo.reset()
    yield
    dynamo.reset()
    torch.set_num_threads(threads)


def swapped(pool_size=2):
    """The tiny Segmenter (seeded weights) with encoder layer 0 and the mask head on MiTA
    and encoder layer 1 dense on the fast path."""
    torch.manual_seed(0)
    model = init_model(VIT_T, cfg_options=TINY,
                       mita_cfg=dict(pool_size=pool_size, topk=8, layers=[0],
                                     include_head=True))
    kinds = [type(layer.attn) for layer in (*model.backbone.layers, *model.decode_head.layers)]
    assert kinds == [MiTAAttention, type(model.backbone.layers[1].attn), MiTAAttention]
    assert type(model.backbone.layers[1].attn.attn) is FastMultiheadAttention
    return model


INPUTS = torch.randn(2, 3, 64, 80, generator=torch.Generator().manual_seed(1))   # 8x10 grid


@pytest.mark.parametrize('train', [False, True], ids=['inference', 'training'])
@pytest.mark.parametrize('pool_size', [2, 12], ids=['pool-2', 'pool-over-grid'])
def test_no_graph_break(train, pool_size):
    """One graph, no break: grid hooks, argument checks, backend dispatch, and settings
    reduced to the grid (pool 12 on an 8x10 grid, whose log line eager forwards write)."""
    model = swapped(pool_size).train(train)
    with torch.set_grad_enabled(train):
        explained = dynamo.explain(lambda x: model(x, mode='tensor'))(INPUTS)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_training_equals_eager():
    """Forward and backward of the compiled model (aot_autograd through the MiTA op's
    custom forward and backward ops): the eager output and gradients."""
    model = swapped().train()
    compiled = torch.compile(lambda x: model(x, mode='tensor'), backend='aot_eager')
    grads, outs = [], []
    for fn in (lambda x: model(x, mode='tensor'), compiled):
        model.zero_grad()
        x = INPUTS.clone().requires_grad_()
        out = fn(x)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([x.grad] + [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_inductor_equals_eager():
    """Inductor (C++ on CPU): the eager logits to float32 rounding, the same classes."""
    model = swapped().eval()
    compiled = torch.compile(lambda x: model(x, mode='tensor'))
    with torch.no_grad():
        want, got = model(INPUTS, mode='tensor'), compiled(INPUTS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max())
    assert torch.equal(got.argmax(1), want.argmax(1))


def test_plain_param_groups():
    """mmengine's optimizer constructor (``paramwise_cfg``) leaves ``ConfigDict`` param
    groups, on which a compiled AdamW step fails in Dynamo; after
    :class:`PlainParamGroupsHook` they are plain dicts of the same items, and it compiles.
    :func:`use_plain_param_groups` adds the hook (once) to a config that compiles only."""
    from types import SimpleNamespace

    from mmengine.config import Config, ConfigDict
    from mmengine.optim import DefaultOptimWrapperConstructor

    from mita_seg.engine import PlainParamGroupsHook, use_plain_param_groups
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    wrapper = DefaultOptimWrapperConstructor(  # as the Runner builds it: from a ConfigDict
        ConfigDict(optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.01)),
        dict(custom_keys={'1': dict(decay_mult=0.)}))(model)
    groups = wrapper.optimizer.param_groups
    assert {type(g).__name__ for g in groups} == {'ConfigDict'}
    want = [dict(g) for g in groups]

    @torch.compile(backend='eager')
    def step():
        model(torch.ones(1, 3)).square().sum().backward()
        wrapper.optimizer.step()

    with pytest.raises(Exception, match='UserDefinedDictVariable'):   # torch 2.13
        step()
    PlainParamGroupsHook().before_train(SimpleNamespace(optim_wrapper=wrapper))
    assert wrapper.optimizer.param_groups is groups and {type(g) for g in groups} == {dict}
    assert groups == want and groups[3]['weight_decay'] == 0.0
    dynamo.reset()
    step()

    for compile_cfg, hooks in ((None, 0), (False, 0), (True, 1), (dict(), 1)):
        cfg = Config(dict(compile=compile_cfg, custom_hooks=[dict(type='EMAHook')]))
        use_plain_param_groups(cfg)
        use_plain_param_groups(cfg)
        assert [h['type'] for h in cfg.custom_hooks] == ['EMAHook'] + [
            'PlainParamGroupsHook'] * hooks


@pytest.mark.slow
def test_mmengine_compile_trains(tiny_data, tmp_path, tools):
    """MMEngine's ``compile`` (the Runner's whole ``train_step``, AdamW's step included,
    whose ``ConfigDict`` param groups Dynamo failed on before ``PlainParamGroupsHook``)
    trains the tiny MiTA UperNet config 2 iterations, with eager's losses. ``aot_eager``:
    Dynamo and aot_autograd without inductor's C++ compile (minutes per iteration on 2
    cores; ``tools/train.py --cfg-options compile=True`` runs it, see docs/training.md)."""
    opts = {}
    for opt in tools.data_options(tiny_data):
        key, value = opt.split('=', 1)
        opts[key] = False if value == 'False' else (int(value) if value.isdigit() else value)
    opts.update({'train_cfg.max_iters': 2, 'train_cfg.val_interval': 100,
                 'default_hooks.checkpoint.interval': 100, 'default_hooks.logger.interval': 1,
                 'train_dataloader.batch_size': 2})
    losses = []
    for compile_cfg in (None, dict(backend='aot_eager')):
        dynamo.reset()
        cfg = load_config(TINY_UPERNET, opts, str(tmp_path / f'work{len(losses)}'))
        cfg.compile = compile_cfg
        prepare_config(cfg)
        runner = build_runner(cfg)
        assert isinstance(runner.model.backbone.layers[0].attn, MiTAAttention)
        runner.train()
        assert runner.iter == 2
        assert ('train_step' in vars(runner.model)) == (compile_cfg is not None)  # compiled
        losses.append(torch.tensor(runner.message_hub.log_scalars['train/loss'].data[0]))
    assert losses[0].shape == (2, ) and torch.isfinite(losses[0]).all(), losses[0]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
