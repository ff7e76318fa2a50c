"""The MMEngine Runner as the study's stages use it: the data options of every config, a test
Runner and its model, and a model evaluated with the test loop of ``tools/test.py`` (its
metrics, cost and measured images/s)."""
import gc
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from mmengine.config import Config
from mmengine.model import is_model_wrapper
from mmengine.runner import Runner

from mita_seg.analysis.attention_macs import attention_gmacs
from mita_seg.analysis.timing import median_time
from mita_seg.apis import build_runner, load_config, mita_config, prepare_config
from mita_seg.apis.sweep import model_gflops
from .settings import StudySettings

__all__ = ['LOADERS', 'data_options', 'unwrap', 'test_runner', 'images_per_second',
           'evaluate']

LOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')


def data_options(data_root: str, workers: int = 0) -> dict:
    """``--cfg-options`` that point the three dataloaders at ``data_root``."""
    opts = {}
    for loader in LOADERS:
        opts[f'{loader}.dataset.data_root'] = data_root
        opts[f'{loader}.num_workers'] = workers
        opts[f'{loader}.persistent_workers'] = workers > 0
    return opts


def unwrap(model: nn.Module) -> nn.Module:
    """``model`` without its distributed wrapper, if any."""
    return model.module if is_model_wrapper(model) else model


def test_runner(config, opts: dict, checkpoint: str, work_dir: str, s: StudySettings,
                mita_cfg: Optional[dict] = None) -> Tuple[Runner, nn.Module]:
    """A Runner with the test loop of ``config`` (on MiTA with ``mita_cfg`` if given) and
    ``checkpoint``, and its model."""
    cfg = load_config(config, opts, work_dir)
    if mita_cfg:
        cfg = mita_config(cfg, mita_cfg)
    prepare_config(cfg, checkpoint=checkpoint)
    runner = build_runner(cfg, s.verbose)
    return runner, unwrap(runner.model)


def images_per_second(model: nn.Module, batch: dict, min_run_time: float) -> Dict[str, float]:
    """Test-mode images/s of ``model`` on ``batch`` (``test_step``: preprocessing, forward
    under the config's test mode, post-processing), the median of
    :func:`mita_seg.analysis.timing.median_time` (``torch.utils.benchmark.Timer`` with
    torch's threads)."""

    def run():
        with torch.no_grad():
            model.test_step(batch)

    model.eval()
    return {'img_per_s': len(batch['inputs']) / median_time(run, min_run_time)}


def evaluate(cfg: Config, checkpoint: str, work_dir: str, settings: StudySettings) -> dict:
    """The metrics of the test loop of ``tools/test.py`` (mIoU, mAcc, aAcc and whatever
    else the config's test evaluator gives), cost and images/s of ``cfg`` with
    ``checkpoint``."""
    cfg.work_dir = work_dir
    prepare_config(cfg, checkpoint=checkpoint)
    runner = build_runner(cfg, settings.verbose)
    metrics = runner.test()
    model = unwrap(runner.model)
    batch = next(iter(runner.test_dataloader))
    row = dict({k: float(v) for k, v in metrics.items()},   # mIoU, mAcc, aAcc, acc_* ...
               attn_GMACs=attention_gmacs(model, [batch]),
               model_GFLOPs=model_gflops(model, batch),
               **images_per_second(model, batch, settings.speed_min_run_time))
    del runner, model
    gc.collect()
    return row
