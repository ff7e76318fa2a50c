"""mita_seg.apis, the library under the tools: configs, the one --mita-cfg, models loaded
strictly and weights-only, single-image inference (also through tools/image_demo.py)."""
import argparse
import os.path as osp

import numpy as np
import pytest
import torch

from mita_seg.apis import MiTASegInferencer, inference_model, init_model, load_config
from mita_seg.cli import add_mita_args, swap_settings
from mita_seg.models import MiTAAttention
from mita_seg.utils import CheckpointMismatchError

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SEGMENTER_T = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'


def test_load_config(tmp_path):
    # mmseg's own configs by name, with --cfg-options; work_dir: mmseg's default
    cfg = load_config(SEGMENTER_T, {'model.backbone.num_layers': 2})
    assert cfg.model.backbone.num_layers == 2
    assert cfg.work_dir == osp.join('./work_dirs', 'segmenter_vit-t_mask_8xb1-160k_ade20k-512x512')
    # a file; the work_dir given wins
    cfg = load_config(osp.join(ROOT, 'configs', 'mita_upernet_ade20k.py'), work_dir='w')
    assert cfg.work_dir == 'w' and cfg.model.backbone.type == 'MiTAVisionTransformer'
    # a config that does not exist: say what a config is
    with pytest.raises(FileNotFoundError, match="'mmseg::<dir>/<config>.py'"):
        load_config('configs/nope.py')
    with pytest.raises(FileNotFoundError, match='does not exist'):
        load_config('mmseg::segmenter/nope.py')


def parser(**kwargs):
    p = argparse.ArgumentParser(prog='tool')
    add_mita_args(p, **kwargs)
    return p


def parse(argv, **kwargs):
    p = parser(**kwargs)
    args = p.parse_args(argv)
    return swap_settings(p, args)


def test_mita_cfg_parses_every_setting():
    assert parse([]) is None                                      # no swap asked for
    assert parse(['--swap-attn', 'mita']) == {}                   # the defaults
    assert parse(['--mita-cfg', 'topk=16', 'pool_size=4,6', 'layers=[0,1]',
                  'include_head=False', 'shared_scale=0.05', 'with_shared_expert=True']) == dict(
        topk=16, pool_size=[4, 6], layers=[0, 1], include_head=False, shared_scale=0.05,
        with_shared_expert=True)                                  # --mita-cfg implies the swap
    assert parse(['--mita-cfg', 'router_topk=2'], swap_flag=False) == dict(router_topk=2)


@pytest.mark.parametrize('argv, message', [
    (['--mita-cfg', 'top_k=3'], "unknown MiTA setting 'top_k'; allowed: pool_size (an int"),
    (['--mita-cfg', 'pool_size=abc'], "pool_size='abc': pool_size must be an int >= 1"),
    (['--mita-cfg', 'pool_size=0'], 'pool_size=0: pool_size must be an int >= 1'),
    (['--mita-cfg', 'topk=-3'], 'topk=-3: topk must be an int >= 1'),
    (['--mita-cfg', 'with_dwc=True'], "unknown MiTA setting 'with_dwc'"),   # adds weights
    (['--swap-attn', 'none', '--mita-cfg', 'topk=3'], '--mita-cfg needs --swap-attn mita'),
], ids=['unknown', 'not-int', 'pool-0', 'topk-negative', 'with-dwc', 'swap-none'])
def test_bad_mita_cfg_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2                                      # argparse's usage error
    assert message in capsys.readouterr().err


def test_a_tool_can_own_settings(capsys):
    # swap_sweep sets pool_size/topk from --pool-sizes/--topks
    with pytest.raises(SystemExit):
        parse(['--mita-cfg', 'topk=3'], swap_flag=False, exclude=('pool_size', 'topk'))
    assert "unknown MiTA setting 'topk'; allowed: router_topk" in capsys.readouterr().err


def test_init_model_loads_strictly_and_swaps(segmenter_ckpt, tiny_data):
    config, ckpt = segmenter_ckpt
    model = init_model(config, ckpt)
    assert not any(isinstance(m, MiTAAttention) for m in model.modules())
    assert model.dataset_meta['classes'][:3] == ('wall', 'building', 'sky')
    swapped = init_model(config, ckpt, mita_cfg=dict(pool_size=4, topk=32, include_head=False))
    attns = [m for m in swapped.modules() if isinstance(m, MiTAAttention)]
    assert len(attns) == 4 and (attns[0].pool_size, attns[0].topk) == (4, 32)
    for k, v in model.state_dict().items():
        assert torch.equal(v, swapped.state_dict()[k]), k
    # the weights were loaded: the output is not that of a freshly initialised model
    img = osp.join(tiny_data, 'images', 'validation', 'ADE_val_00000001.jpg')
    fresh = init_model(config)
    logits = [inference_model(m, img).seg_logits.data for m in (model, fresh)]
    assert logits[0].shape == (150, 128, 128) and not torch.allclose(*logits)

    # a checkpoint for another model: an error listing the keys, nothing loaded
    with pytest.raises(CheckpointMismatchError, match=r'missing keys \(\d+\): auxiliary_head'
                       r'(.|\n)*unexpected keys \(\d+\): decode_head.classes_proj.weight, '
                       r'decode_head.cls_emb'):
        init_model(osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-'
                            '128x128.py'), ckpt)


def test_class_names_without_checkpoint_meta(segmenter_ckpt, tmp_path):
    config, ckpt = segmenter_ckpt
    bare = tmp_path / 'bare.pth'
    torch.save(init_model(config, ckpt).state_dict(), bare)      # a bare state dict
    model = init_model(config, str(bare))
    assert len(model.dataset_meta['classes']) == 150              # the config's dataset


def test_class_names_of_the_config_dataset():
    from mita_seg.apis.model import dataset_meta
    cfg = load_config(osp.join(ROOT, 'configs', 'baselines',
                               'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py'))
    # a custom dataset gives its classes in the config (mmseg's BaseSegDataset + metainfo),
    # not in a class: those names, not none (show_result_pyplot then failed on None)
    cfg.test_dataloader.dataset.type = 'BaseSegDataset'
    cfg.test_dataloader.dataset.metainfo = dict(classes=('road', 'car'),
                                                palette=[[1, 2, 3], [4, 5, 6]])
    assert dataset_meta(cfg, None) == dict(classes=('road', 'car'),
                                           palette=[[1, 2, 3], [4, 5, 6]])
    # a subset of ADE20K's classes in the config: those, with their palette (mmseg's rule),
    # not ADE20K's 150 names
    cfg.test_dataloader.dataset.type = 'ADE20KDataset'
    cfg.test_dataloader.dataset.metainfo = dict(classes=('wall', 'sky'))
    meta = dataset_meta(cfg, None)
    assert meta['classes'] == ('wall', 'sky')
    assert meta['palette'] == [[120, 120, 120], [6, 230, 230]]
    # classes without a palette: mmseg's seeded random one, as many colours as classes
    cfg.test_dataloader.dataset.type = 'BaseSegDataset'
    cfg.test_dataloader.dataset.metainfo = dict(classes=('a', 'b', 'c'))
    assert len(dataset_meta(cfg, None)['palette']) == 3


def test_class_names_of_a_model_only_config(tmp_path):
    from mita_seg.apis import show_result_pyplot
    cfg = load_config(osp.join(ROOT, 'configs', 'baselines',
                               'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py'))
    bare = tmp_path / 'bare.pth'
    torch.save(init_model(cfg).state_dict(), bare)               # no meta
    # test_dataloader = None (a config without a test split) was an AttributeError
    cfg.test_dataloader = None
    model = init_model(cfg, str(bare))
    # mmseg's rule: a dataset with the model's number of classes (ADE20K's 150)
    assert len(model.dataset_meta['classes']) == 150 == len(model.dataset_meta['palette'])
    # no dataset has that many classes: named by their index, and the drawing works
    cfg.model.decode_head.num_classes = 5
    torch.save(init_model(cfg).state_dict(), bare)
    model = init_model(cfg, str(bare))
    assert model.dataset_meta['classes'] == tuple('01234')
    img = np.random.RandomState(0).randint(0, 255, (64, 80, 3), dtype=np.uint8)
    drawn = show_result_pyplot(model, img, inference_model(model, img), show=False)
    assert drawn.shape == (64, 80, 3)


def test_inferencer_class_names_without_checkpoint_meta(tmp_path):
    config = osp.join(ROOT, 'configs', 'baselines',
                      'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')
    bare = tmp_path / 'bare.pth'
    torch.save(init_model(config).state_dict(), bare)             # no meta
    # the config's ADE20K names (as init_model), not mmseg's Cityscapes 19 for a 150-class
    # model (the drawing then left out every class id >= 19)
    inferencer = MiTASegInferencer(load_config(config), weights=str(bare), device='cpu')
    assert len(inferencer.model.dataset_meta['classes']) == 150
    assert inferencer.model.dataset_meta == init_model(config, str(bare)).dataset_meta


def test_inferencer_with_swap(segmenter_ckpt, tiny_data, tmp_path):
    config, ckpt = segmenter_ckpt
    img = osp.join(tiny_data, 'images', 'validation', 'ADE_val_00000002.jpg')
    inferencer = MiTASegInferencer(load_config(config), weights=ckpt, device='cpu',
                                   mita_cfg=dict(pool_size=4, topk=32))
    assert sum(isinstance(m, MiTAAttention) for m in inferencer.model.modules()) == 4  # encoder
    result = inferencer(img, out_dir=str(tmp_path))
    pred = result['predictions']
    assert pred.shape == (128, 128) and pred.dtype.kind == 'i'
    assert (tmp_path / 'vis' / 'ADE_val_00000002.jpg').stat().st_size > 1000
    # the same prediction as inference_model on init_model's swapped model
    model = init_model(config, ckpt, mita_cfg=dict(pool_size=4, topk=32))
    expected = inference_model(model, img).pred_sem_seg.data[0].numpy()
    np.testing.assert_array_equal(pred, expected)
    # weights that do not fit: an error, not random weights
    mismatched = {k: v for k, v in torch.load(ckpt, weights_only=True)['state_dict'].items()
                  if not k.startswith('decode_head.')}
    torch.save(dict(state_dict=mismatched), tmp_path / 'partial.pth')
    with pytest.raises(CheckpointMismatchError, match='missing keys'):
        MiTASegInferencer(load_config(config), weights=str(tmp_path / 'partial.pth'),
                          device='cpu')


@pytest.mark.slow
def test_image_demo(segmenter_ckpt, tiny_data, tools, tmp_path):
    import cv2
    config, ckpt = segmenter_ckpt
    img = osp.join(tiny_data, 'images', 'validation', 'ADE_val_00000003.jpg')
    out_file = tmp_path / 'seg.png'
    _, out = tools('tools/image_demo.py', img, config, ckpt, '--out-file', out_file,
                   '--swap-attn', 'mita', '--mita-cfg', 'pool_size=4', 'topk=32')
    drawing = cv2.imread(str(out_file))
    assert drawing.shape == (128, 128, 3)
    # the classes it names are those of inference_model on the same swapped model
    model = init_model(config, ckpt, mita_cfg=dict(pool_size=4, topk=32))
    pred = inference_model(model, img).pred_sem_seg.data[0]
    ids, counts = pred.unique(return_counts=True)
    top = model.dataset_meta['classes'][int(ids[counts.argmax()])].strip()
    share = 100 * counts.max().item() / pred.numel()
    assert f'wrote {out_file}: 128x128, {len(ids)} classes: {top} {share:.1f}%' in out
    assert 'swap_attention: 4 attention modules on MiTA' in out   # the encoder's
