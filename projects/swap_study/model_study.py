"""One model trained with one seed, as the study's stages see it: :class:`ModelStudy`, what
every stage reads and writes (the run's settings and options, its result, the trained
checkpoint, the unswapped row) and the machinery they share (a stage whose failure is
recorded, progress lines, a test Runner swept over points). The stages are the modules
:mod:`.training`, :mod:`.sweep`, :mod:`.head`, :mod:`.kinds`, :mod:`.plans`,
:mod:`.finetune`, :mod:`.selection` and :mod:`.native`, each a function of a
:class:`ModelStudy`; :func:`projects.swap_study.study.study_model` calls them in order."""
import gc
import json
import os
import os.path as osp
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from mita_seg.apis import swap_sweep
from mita_seg.apis.sweep import SweepRow
from mita_seg.engine import atomic_write_text
from mita_seg.setting import MiTASetting
from mita_seg.utils.cfg_options import CfgOptionsError
from .runner import data_options, images_per_second, test_runner
from .settings import StudySettings

__all__ = ['ModelStudy', 'PAPER_MARK', 'CONTROL_MARK', 'ACROSS_MARK', 'STAGES_FILE']

# the fields that mark the rows a report looks for (projects.swap_study.study lists them):
# at the paper's compression, the target (42.0) on the MiTA rows found there and the rows
# at its budget (equal-cost, plans); the spelling of a destructive control's row
# (``1:1:route``, ``window:1``); True on a plan whose layers may take every kind
PAPER_MARK = 'paper_reduction_%'
CONTROL_MARK = 'control'
ACROSS_MARK = 'across_kinds'
# the result after each stage of an unfinished run, in its work dir (ModelStudy.save_stages):
# a killed run resumes after the last one (ModelStudy.resume)
STAGES_FILE = 'stages.json'


class ModelStudy:
    """One model trained with one seed through the study's stages (the module docstring of
    :mod:`projects.swap_study.study`, 1 to 6), each writing its rows, notes and errors into
    :attr:`result` (what :func:`~projects.swap_study.study.study_model` returns). A stage
    that fails is recorded in ``result['errors']`` and the study goes on with the others,
    except after the training or the sweep, which the others need; a ``--cfg-options`` value
    a model cannot be built with (:class:`~mita_seg.utils.cfg_options.CfgOptionsError`) ends
    the study at once.

    Args:
        name (str): the model's name (in progress lines and file names).
        config (str): its standard-attention config.
        work_dir (str): this run's directory (``WORK_DIR/<name>/seed<seed>``).
        settings (StudySettings): the run's settings, one seed (:meth:`StudySettings.for_run`).
        progress (Callable): called with each progress line.
        fig_dir (str): where the selection maps go.

    Attributes:
        s (StudySettings): the run's settings.
        opts (dict): the ``--cfg-options`` of every config of the run (the data, the seed).
        result (dict): the run's result so far.
        files (str): the stem of the run's figure names.
        ckpt (str): the trained standard-attention checkpoint (after the training).
        base (dict): the unswapped row, which every row's reductions are against (after the
            sweep).
        paper (list[MiTASetting]): the MiTA settings at the paper's compression, one per k
            of ``paper_topks``, the first a budget of the taxonomy and the plans (after the
            sweep; none without ``paper_reduction``).
        calls (list): the attention calls of the model swapped to MiTA on the first test
            batch, which price any setting on it (after the sweep).
        runnable (tuple[str]): the kinds of ``kinds`` this model's attention runs, and
            ``skipped`` the others, each with why (after the sweep).
    """

    def __init__(self, name: str, config: str, work_dir: str, settings: StudySettings,
                 progress: Callable[[str], None], fig_dir: str):
        self.t_model = time.time()
        self.name, self.config, self.work_dir, self.fig_dir = name, config, work_dir, fig_dir
        self.s, self.progress = settings, progress
        (seed, ) = settings.seeds
        self.opts = dict(data_options(settings.data_root, settings.workers),
                         **(settings.cfg_options or {}))
        self.opts['randomness.seed'] = seed
        self.result = dict(name=name, config=config, seed=seed, settings=settings.key(),
                           rows=[], errors=[], load=[], notes=[], native=[],
                           started=time.strftime('%Y-%m-%d %H:%M:%S'))
        self.files = f'{name}_seed{seed}'   # figure names
        self.ckpt: Optional[str] = None
        self.base: Optional[dict] = None
        self.paper: List[MiTASetting] = []
        self.calls: list = []
        self.runnable: Tuple[str, ...] = ()
        self.skipped: Dict[str, str] = {}

    def finish(self) -> dict:
        """:attr:`result` with the load at the end, the seconds and the time it finished."""
        self.load('end')
        self.result['seconds'] = round(time.time() - self.t_model, 1)
        self.result['finished'] = time.strftime('%Y-%m-%d %H:%M:%S')
        return self.result

    def save_stages(self, done: Sequence[str]) -> None:
        """Write :attr:`result` after the stages ``done`` (none of which failed) to
        ``STAGES_FILE`` in the work dir, whole (:func:`~mita_seg.engine.atomic_write_text`),
        with the seconds so far: a killed run resumes after them (:meth:`resume`)."""
        atomic_write_text(json.dumps(dict(
            settings=self.result['settings'], config=self.config, done=list(done),
            seconds=round(time.time() - self.t_model, 1), result=self.result), indent=1),
            osp.join(self.work_dir, STAGES_FILE))

    def resume(self) -> Tuple[str, ...]:
        """With ``reuse``, the stages an earlier run of the same settings and config finished
        (``STAGES_FILE``): its result becomes :attr:`result` (``resumed`` records when and
        after which stage) and its seconds count in this run's; () otherwise."""
        path = osp.join(self.work_dir, STAGES_FILE)
        if not (self.s.reuse and osp.isfile(path)):
            return ()
        try:
            with open(path, encoding='utf-8') as f:
                saved = json.load(f)
            ok = (saved['settings'] == self.result['settings'] and saved['config'] == self.config
                  and saved['done'] and isinstance(saved['result'], dict))
        except (OSError, ValueError, KeyError, TypeError) as e:   # edited or cut by hand
            self.progress(f'{self.name}: {path} cannot be read ({type(e).__name__}: {e}); '
                          'not resumed (the run starts from the beginning)')
            return ()
        if not ok:
            self.progress(f'{self.name}: {path} is of other settings; not resumed')
            return ()
        self.result = saved['result']
        self.result.setdefault('resumed', []).append(dict(
            after=saved['done'][-1], at=time.strftime('%Y-%m-%d %H:%M:%S')))
        self.t_model -= saved['seconds']
        self.progress(f"{self.name}: resuming after {', '.join(saved['done'])} ({path})")
        return tuple(saved['done'])

    def load(self, stage: str) -> None:
        """Record the machine's load (1-minute average) at the start of ``stage``."""
        self.result['load'].append((stage, round(os.getloadavg()[0], 2)))

    def stage(self, label: str, fn: Callable[[], Any]) -> Any:
        """Run one stage, ``fn()``; an error is recorded (and the study goes on with the
        others): None then."""
        progress, name = self.progress, self.name
        progress(f'{name}: {label}')
        self.load(label)
        t0 = time.time()
        try:
            out = fn()
        except CfgOptionsError:   # a --cfg-options value fails every stage alike: one line
            raise
        except Exception as e:  # noqa: BLE001  recorded, reported, exit status 1 at the end
            msg = f'{label}: {type(e).__name__}: {e}'
            self.result['errors'].append(msg)
            progress(f'{name}: FAILED {msg}\n{traceback.format_exc()}')
            return None
        progress(f'{name}: {label} done in {time.time() - t0:.0f}s')
        return out

    def say(self, prefix: str) -> Callable[[str], None]:
        """A progress callback: each line as ``NAME: PREFIXline``."""
        return lambda line: self.progress(f'{self.name}: {prefix}{line}')

    def measure(self, model: nn.Module, batch: dict) -> Dict[str, float]:
        """The images/s of a sweep's row (:func:`~.runner.images_per_second`)."""
        return images_per_second(model, batch, self.s.speed_min_run_time)

    def sweep_with(self, checkpoint: str, work_dir: str, points, prefix: str,
                   mita_cfg: Optional[dict] = None, after: Optional[Callable] = None,
                   **sweep_cfg) -> Optional[Tuple[List[SweepRow], Any]]:
        """A test Runner of the config with ``checkpoint`` (on MiTA with ``mita_cfg``) in
        ``work_dir``, swept over ``points`` (:func:`~mita_seg.apis.swap_sweep` with
        ``sweep_cfg``, progress lines ``PREFIX...``), then freed.

        Args:
            points (list[SweepPoint] | Callable): the points, or
                ``points(runner, model)`` giving them (None: nothing to sweep).
            after (Callable, optional): ``after(runner, model, points)`` after the sweep.

        Returns:
            tuple | None: the rows and what ``after`` returned (None without it); None when
            ``points`` gave None.
        """
        runner, model = test_runner(self.config, self.opts, checkpoint, work_dir, self.s,
                                    mita_cfg)
        todo = points(runner, model) if callable(points) else points
        out = None
        if todo is not None:
            rows = swap_sweep(runner, todo, measure=self.measure, progress=self.say(prefix),
                              **sweep_cfg)
            out = rows, (after(runner, model, todo) if after else None)
        del runner, model
        gc.collect()
        return out

    def check_base(self, row: SweepRow, what: str, when: str = '') -> None:
        """An error unless ``row``, the unswapped row of a later sweep of the same model on
        the same test, has the sweep's mIoU."""
        if row.mIoU != self.base['mIoU']:
            self.result['errors'].append(f'{what}: the unswapped model gave mIoU '
                                         f"{row.mIoU}{when}, {self.base['mIoU']} in the sweep")

    def add_row(self, row: dict, **extra) -> None:
        """Append ``row`` (with ``extra``) to the result's rows."""
        row.update(extra)
        self.result['rows'].append(row)
