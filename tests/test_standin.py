"""``tools/make_standin_checkpoint.py``: the README's swap example offline. The stand-in of
mmseg's Segmenter ViT-T config is in the model zoo's format, loads strictly into the same
config, swaps to MiTA and segments ``demo/demo.jpg``; the same config and seed give the same
file byte for byte; a file at ``--out`` that is not a stand-in (a downloaded checkpoint) is
kept unless ``--force``, an empty one (a failed download) is replaced."""
import hashlib
import os.path as osp

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
README_CONFIG = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
TINY = osp.join(ROOT, 'configs', 'baselines',
                'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')
DEMO = osp.join(ROOT, 'demo', 'demo.jpg')


def digest(path) -> str:
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_standin_runs_the_readme_example(tools, tmp_path):
    from mita_seg.apis import inference_model, init_model, load_config
    from mita_seg.models import MiTAAttention
    from mita_seg.utils import load_local_checkpoint
    ckpt = tmp_path / 'segmenter_vit-t.pth'
    ckpt.write_bytes(b'')              # what a failed wget leaves: replaced
    _, out = tools('tools/make_standin_checkpoint.py', README_CONFIG, '--out', ckpt)
    assert out.strip().splitlines()[-1].startswith(
        f'wrote {ckpt}: segmenter_vit-t_mask_8xb1-160k_ade20k-512x512 with seeded random '
        'weights (seed 0, 6.71 M parameters'), out
    saved = load_local_checkpoint(str(ckpt))
    assert set(saved) == {'meta', 'state_dict'}
    meta = saved['meta']
    assert meta['stand_in']['seed'] == 0 and meta['stand_in']['config'] == README_CONFIG
    assert len(meta['dataset_meta']['classes']) == 150       # ADE20K's, for the drawings
    # the README's snippet: strict load, swap, one image
    cfg = load_config(README_CONFIG)
    model = init_model(cfg, str(ckpt), mita_cfg=dict(pool_size=7, topk=49))
    assert sum(isinstance(m, MiTAAttention) for m in model.modules()) == 12
    result = inference_model(model, DEMO)
    assert tuple(result.pred_sem_seg.data.shape) == (1, 256, 256)


def test_standin_is_deterministic_and_keeps_other_files(tmp_path):
    from mita_seg.apis import make_standin_checkpoint
    from mita_seg.utils import InputError
    a, b = tmp_path / 'a.pth', tmp_path / 'b.pth'
    info = make_standin_checkpoint(TINY, str(a))
    assert info['config'] == 'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128'
    make_standin_checkpoint(TINY, str(b))
    assert digest(a) == digest(b)                 # same config, same seed: the same bytes
    make_standin_checkpoint(TINY, str(b))          # an earlier stand-in is replaced
    make_standin_checkpoint(TINY, str(b), seed=1)
    assert digest(a) != digest(b)
    # another file at --out (a downloaded checkpoint) is kept unless forced
    real = tmp_path / 'real.pth'
    torch.save({'meta': {}, 'state_dict': {'w': torch.ones(3)}}, real)
    before = digest(real)
    with pytest.raises(InputError, match=r'real\.pth exists \(\d+ bytes\) and is not a '
                       'stand-in made by this command'):
        make_standin_checkpoint(TINY, str(real))
    assert digest(real) == before
    make_standin_checkpoint(TINY, str(real), force=True)
    assert digest(real) == digest(a)
