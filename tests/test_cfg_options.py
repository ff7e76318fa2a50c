"""``--cfg-options`` remembered on a config and named when a part of it cannot be built with
them (:mod:`mita_seg.utils.cfg_options`): the option the error points at, the value the
config had, a misspelt key and the key it was meant to be; and what the user did not change
(or a mita_seg error that says what to do already) passes through unchanged. The tools'
side (one ``error:`` line in each) is in ``tests/test_bad_input.py`` (``cfg_options_cases``).
"""
import copy
import os.path as osp

import pytest
from mmengine.config import Config

from mita_seg.utils.cfg_options import (MISSING, CfgOptionsError, blame_cfg_options,
                                        cfg_options_of, merge_cfg_options)
from mita_seg.utils.errors import InputError

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CFG = osp.join(ROOT, 'configs', 'baselines',
               'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')


def config(**options):
    cfg = Config(dict(model=dict(type='M', backbone=dict(embed_dims=64, num_layers=4)),
                      test_dataloader=dict(batch_size=1, dataset=dict(data_root='d')),
                      param_scheduler=[dict(end=10), dict(end=20)]))
    return merge_cfg_options(cfg, options)


def blamed(cfg, error, sections=('model', )):
    with pytest.raises(BaseException) as e:
        with blame_cfg_options(cfg, 'the model', sections):
            raise error
    return e.value


def test_options_remembered_with_what_they_replaced():
    cfg = config(**{'model.backbone.embed_dims': 'abc', 'model.backbone.embed_dim': 64,
                    'param_scheduler.1.end': 5})
    assert cfg.model.backbone.embed_dims == 'abc' and cfg.param_scheduler[1].end == 5
    assert cfg_options_of(cfg) == {'model.backbone.embed_dims': ('abc', 64),
                                   'model.backbone.embed_dim': (64, MISSING),
                                   'param_scheduler.1.end': (5, 20)}
    # copies keep them (the Runner deep-copies its config); a dump does not show them
    assert cfg_options_of(copy.deepcopy(cfg)) == cfg_options_of(cfg) == \
        cfg_options_of(cfg.copy())
    assert copy.deepcopy(cfg_options_of(cfg)['model.backbone.embed_dim'][1]) is MISSING
    assert '_mita_cfg_options' not in cfg.pretty_text
    # merged twice: the value the config first had is kept
    merge_cfg_options(cfg, {'model.backbone.embed_dims': 32})
    assert cfg_options_of(cfg)['model.backbone.embed_dims'] == (32, 64)
    assert cfg_options_of(Config(dict(a=1))) == {} and cfg_options_of(None) == {}


def test_the_option_the_error_points_at():
    cfg = config(**{'model.backbone.embed_dims': 'abc', 'model.backbone.num_layers': 2})
    e = blamed(cfg, TypeError('not all arguments converted during string formatting'))
    assert isinstance(e, CfgOptionsError) and isinstance(e, InputError)
    assert str(e) == ("--cfg-options model.backbone.embed_dims='abc': the model cannot be "
                      'built with it (TypeError: not all arguments converted during string '
                      'formatting); the config has model.backbone.embed_dims=64: give an int')
    assert isinstance(e.__cause__, TypeError)        # the stack's error, chained
    # a misspelt key: the keyword argument the class does not take, and the one it meant
    cfg = config(**{'model.backbone.embed_dim': 64, 'model.backbone.num_layers': 2})
    e = blamed(cfg, TypeError("VisionTransformer.__init__() got an unexpected keyword "
                              "argument 'embed_dim'"))
    assert str(e).startswith('--cfg-options model.backbone.embed_dim=64: the model cannot')
    assert str(e).endswith('; the config has no model.backbone.embed_dim: did you mean '
                           'model.backbone.embed_dims?')
    # a key named in the message; the first line of a long one
    cfg = config(**{'test_dataloader.batch_size': -1,
                    'test_dataloader.dataset.data_root': 'x'})
    e = blamed(cfg, ValueError('batch_size should be a positive integer value, but got '
                               'batch_size=-1\nmore'), ('test_dataloader', ))
    assert 'test_dataloader.batch_size=-1: the model cannot be built with it (ValueError: ' \
        'batch_size should be a positive integer value, but got batch_size=-1); the config ' \
        'has test_dataloader.batch_size=1' in str(e) and 'more' not in str(e)
    # nothing points at one: every option of the part, said as such
    cfg = config(**{'model.backbone.embed_dims': 32, 'model.backbone.num_layers': 2})
    e = blamed(cfg, AssertionError())
    assert str(e) == ('--cfg-options model.backbone.embed_dims=32, model.backbone.num_layers=2:'
                      ' the model cannot be built with one of them (AssertionError)')


def test_what_the_user_did_not_change_passes_through():
    # no option in the part being built (the data root is not the model's)
    cfg = config(**{'test_dataloader.dataset.data_root': 'x'})
    error = TypeError('a bug')
    assert blamed(cfg, error) is error
    assert blamed(config(), error) is error            # no options at all
    # a mita_seg error already says what to do; an OSError is not a bad value
    cfg = config(**{'model.backbone.embed_dims': 'abc'})
    for error in (InputError('x'), FileNotFoundError('f')):
        assert blamed(cfg, error) is error
    from mita_seg.setting import MiTASettingError
    error = MiTASettingError('topk=0')
    assert blamed(cfg, error) is error
    with blame_cfg_options(cfg, 'the model', ('model', )):   # no error: nothing happens
        pass


def test_init_model_names_the_option():
    from mita_seg.apis import init_model, load_config
    cfg = load_config(CFG, {'model.backbone.embed_dims': 'abc'})
    with pytest.raises(CfgOptionsError, match=r"^--cfg-options model\.backbone\.embed_dims='abc'"
                       r': the model cannot be built with it \(TypeError: .*\); the config '
                       r'has model\.backbone\.embed_dims=64: give an int$'):
        init_model(cfg)
    # init_model's own cfg_options too
    with pytest.raises(CfgOptionsError, match='did you mean model.backbone.num_layers'):
        init_model(CFG, cfg_options={'model.backbone.num_layer': 2})
