"""The swap study's orchestrator: the stages of one model and seed in order
(:func:`study_model`), and the run (:func:`run_swap_study`; ``tools/swap_study.py``, ``make
swap-study``). Its settings are :mod:`projects.swap_study.settings`', its rows
:mod:`projects.swap_study.rows`', the tables :mod:`projects.swap_study.report`'s, the figures
:mod:`projects.swap_study.figures`'.

For each ``(name, config)`` of a standard-attention segmentor on the generated ADE20K-format
data and each training seed (``randomness.seed`` of every training), a
:class:`~projects.swap_study.model_study.ModelStudy` goes through the stages, a module each:

1. :mod:`.training`: trains it with MMEngine's Runner (what ``tools/train.py`` runs:
   :func:`~mita_seg.apis.load_config`, :func:`~mita_seg.apis.prepare_config`,
   :func:`~mita_seg.apis.build_runner`) for ``train_iters`` iterations;
2. :mod:`.sweep`: evaluates it unswapped, with its training-free peer, token merging (ToMe,
   :func:`~mita_seg.merge_tokens`) at every merge ratio, swapped to MiTA with no retraining for
   every (pool size, top-k) of the sweep, and MiTA with ToMe together
   (:func:`~mita_seg.apis.swap_sweep`: the test loop of ``tools/test.py``), MiTA and ToMe in the
   encoder only (the paper's swap), each row with the whole-model GFLOPs, the attention GMACs
   and the measured images/s; then route-only MiTA with every key in every expert, which is
   exactly softmax attention, so its mIoU must equal the unswapped one (a check of the whole
   path), and the destructive controls, every token reading one key (``1:1:route``) and each
   token its own (``window:1``, where the model's attention runs windows) (no token mixing:
   what a swap loses counts only beside what these lose); the sweep also holds MiTA at the
   paper's compression (42% fewer model FLOPs: per k, the pool side each model's own FLOP
   count puts nearest it); :mod:`.head`: then with Segmenter's mask head too, its class
   tokens global and, to show why, routed like patches; :mod:`.kinds`: the other attention
   kinds and ToMe at the cost of MiTA settings (and of the paper's compression);
3. :mod:`.plans`: calibrates per-layer swap plans
   (:class:`~mita_seg.apis.calibrate.SwapCalibrator`, on training images) at several FLOP
   budgets (the FLOPs of uniform settings, of the paper's compression, and ToMe's largest
   reduction) and with fewer calibration images, among the MiTA candidates and, at each
   budget, across kinds (each other kind at its setting nearest each budget among the
   candidates: layers may take different kinds), and evaluates each plan on the validation
   images;
4. :mod:`.finetune`: for each fine-tune setting, writes the MiTA config + checkpoint pair with
   :func:`~mita_seg.apis.export_swapped` (``tools/export_swapped.py``) and fine-tunes that pair
   with the Runner for ``finetune_iters``; as a control, trains the unswapped model for the
   same iterations from the same checkpoint with the same schedule;
5. :mod:`.selection`: records which tokens the routed experts select at one setting (the
   paper's M = k = 49 by default) on a few validation images
   (:mod:`mita_seg.analysis.token_selection`);
6. :mod:`.native`: trains the same architecture from scratch *with MiTA* at each ``native``
   setting (the paper's second claim: train with small experts, enlarge them at inference) for
   as many iterations, evaluates each over the same (pool size, top-k) grid with no
   retraining, and maps its token selection by depth.

The rows a report or verdict finds by name (each row's ``kind`` is its type,
:data:`~projects.swap_study.rows.ROW_TYPES`; the marks are
:mod:`~projects.swap_study.model_study`'s ``PAPER_MARK``, ``CONTROL_MARK``,
``ACROSS_MARK``):

- the paper's compression: rows ``kind='swap'`` with ``paper_reduction_%`` (the target,
  42.0; the row's own ``model_reduction_%`` beside it), ``setting`` as the sweep labels it
  (``MiTA M=13x13 k=49``), one per k of ``paper_topks`` (49 first); the taxonomy at its
  budget: rows ``kind='equal-cost'`` whose ``budget`` is that setting's spelling
  (``13:49``), with ``paper_reduction_%``; the plans at its budget: rows ``kind='plan'``,
  ``plan.budget`` that spelling, with ``paper_reduction_%``. Each run's result names the
  settings found in ``paper_compression`` (``target_percent``, ``settings``: ``setting``,
  ``model_reduction_percent``);
- the destructive controls: rows ``kind='check'`` with ``control`` the spelling,
  ``'1:1:route'`` (``setting``: ``every token reads one key (1:1:route: ...)``) and
  ``'window:1'`` (``each token reads its own key (window:1: ...)``); a model whose
  attention cannot run a control has the note ``no window:1 control row (not run by
  MiTABEiTAttention)`` instead;
- the plans across kinds: rows ``kind='plan'`` with ``across_kinds`` True (False on the
  MiTA-only plans), ``setting`` ``calibrated plan across kinds, the FLOPs of MiTA M=7x7
  k=49, 16 images`` beside the MiTA-only ``calibrated plan, the FLOPs of ...``, ``plan``
  (``budget``, ``layers``: each layer's setting of any kind); a model that runs no other
  kind has the note ``no plans across kinds: ...`` instead.

Every row is then reported over the seeds (:func:`~projects.swap_study.rows.aggregate`: mean,
sample standard deviation and the per-seed values). It writes ``WORK_DIR/swap_study.json``
(every number, the machine, the settings, the times), ``WORK_DIR/swap_study.md`` (the tables)
and the figures (mIoU against GFLOPs and against images/s, mIoU against the test-time setting
of the MiTA-trained models, the selection maps). Each training run's results are also kept in
``WORK_DIR/<name>/seed<seed>/result.json``; with ``reuse=True`` a run whose results were
computed with the same settings is not run again (so a model or a seed can be added to a
finished study), and trained checkpoints already there
(``WORK_DIR/<name>/seed<seed>/train/iter_<iters>.pth``) are taken as they are. A run killed
before its end resumes: the result after each stage that finished without an error is kept in
``WORK_DIR/<name>/seed<seed>/stages.json`` (removed once a ``result.json`` without errors is
written), and with ``reuse=True`` the run starts after the last of them (the sweep's state,
the paper's settings, the attention calls and the kinds the model runs, computed again from
the model on one batch; ``resumed`` in the result says when); a training cut short resumes
from its last checkpoint if it was started with the same config
(:func:`~projects.swap_study.training.train`; ``resumed_from`` in its record).
"""
import json
import os
import os.path as osp
import time
from functools import partial
from typing import Callable, Optional, Sequence, Tuple

from mita_seg.analysis.timing import machine
from mita_seg.engine import atomic_write_text
from . import finetune, head, kinds, native, plans, selection, sweep, training
from .figures import plot_kinds, plot_native, plot_study
from .model_study import STAGES_FILE, ModelStudy
from .report import markdown
from .rows import aggregate
from .settings import StudySettings

__all__ = ['Progress', 'machine', 'study_model', 'run_swap_study']


class Progress:
    """Prints ``[swap_study +MMmSSs] line`` and appends it to ``log_file``."""

    def __init__(self, log_file: Optional[str] = None,
                 echo: Callable[[str], None] = lambda s: print(s, flush=True)):
        self.start = time.time()
        self.log_file = log_file
        self.echo = echo

    def elapsed(self) -> float:
        return time.time() - self.start

    def __call__(self, line: str) -> None:
        m, s = divmod(int(self.elapsed()), 60)
        text = f'[swap_study +{m:d}m{s:02d}s] {line}'
        self.echo(text)
        if self.log_file:
            with open(self.log_file, 'a') as f:
                f.write(f'{time.strftime("%H:%M:%S")} {text}\n')


def study_model(name: str, config: str, work_dir: str, settings: StudySettings,
                progress: Callable[[str], None], fig_dir: str) -> dict:
    """Train, sweep, fine-tune and map one model with one seed (``settings.seeds``, one:
    :meth:`StudySettings.for_run`; see the module docstring): every stage, in order, on one
    :class:`~projects.swap_study.model_study.ModelStudy`. The others need the training and
    the sweep: when either fails, the result so far (without ``seconds`` and ``finished``).

    Returns:
        dict: ``name, config, seed, input, train, rows, selection, seconds, load, errors``;
        ``rows`` as :func:`~projects.swap_study.rows.study_row` makes them, ``kind`` one of
        :data:`~projects.swap_study.rows.ROW_TYPES`.
    """
    study = ModelStudy(name, config, work_dir, settings, progress, fig_dir)
    done = study.resume()
    finished, clean = list(done), True
    for key, run, restore in _stages(settings):
        if key in done:
            if restore and study.stage(f'resumed after {done[-1]}: restoring the {key}',
                                       lambda: restore(study) or True) is None:
                return study.result
            continue
        errors = len(study.result['errors'])
        if run(study) is False:   # the training or the sweep failed: the others need them
            return study.result
        clean = clean and len(study.result['errors']) == errors
        if clean:   # a resumed run starts after the last stage of an unbroken line
            finished.append(key)
            study.save_stages(finished)
    return study.finish()


def _stages(s: StudySettings) -> list:
    """The stages ``settings`` asks for, in order: ``(key, run, restore)``, ``run(study)``
    the stage, ``restore(study)`` (or None) what a resumed run does instead once it ran."""
    stages = [('training', training.run, training.restore), ('sweep', sweep.run, sweep.restore),
              ('head', head.run, None)]
    stages += [('kinds', kinds.run, None)] if s.kind_budgets else []
    stages += [('plans', plans.run, None)] if s.plan_budgets else []
    stages += [(f'finetune {x.text}', partial(finetune.run, setting=x), None)
               for x in s.finetune]
    stages += [('control', finetune.control, None)] if s.control else []
    stages += [('selection', selection.run, None)] if s.selection and s.selection_images else []
    stages += [(f'native {x.text}', partial(native.run, setting=x), None) for x in s.native]
    return stages


def _figures(models: Sequence[dict], fig_dir: str) -> list:
    """The study's figures: mIoU against cost, the kinds at equal cost (if any), each
    model's MiTA-trained runs (if any), then every selection map."""
    figures = [plot_study(models, osp.join(fig_dir, 'swap_study.png'))]
    figures += [plot_kinds(models, osp.join(fig_dir, 'swap_study_kinds.png'))
                ] if any(r['kind'] == 'equal-cost' for res in models for r in res['rows']) else []
    figures += [plot_native(res, osp.join(fig_dir, f"{res['name']}_native.png"))
                for res in models if any(n.get('rows') for n in res.get('native', []))]
    figures += [p for res in models
                for sel in [res.get('selection', {})] + [
                    n.get('selection', {}) for n in res.get('native', [])]
                for p in sel.get('figures', [])]
    return figures


def run_swap_study(models: Sequence[Tuple[str, str]], work_dir: str, settings: StudySettings,
                   fig_dir: Optional[str] = None,
                   progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run the study on every ``(name, config)`` and write its JSON, table and figures.

    Args:
        models (Sequence[tuple[str, str]]): names (used in file names and the table) and
            standard-attention configs (files or ``mmseg::`` names).
        work_dir (str): runs, checkpoints, ``swap_study.json``, ``swap_study.md``.
        settings (StudySettings): what to run (checked first).
        fig_dir (str, optional): where the PNGs go. Default: ``WORK_DIR/figures``.
        progress (Callable, optional): called with each progress line. Default: a
            :class:`Progress` printing to stdout and ``WORK_DIR/progress.log``.

    Returns:
        dict: the study, as written to ``swap_study.json``: ``machine, settings, models,
        figures, outputs, errors``; each model as :func:`study_model` returns it.

    Raises:
        ValueError: a bad setting, duplicate names or no model.
        FileNotFoundError: the data or a config is missing.
    """
    settings.check()
    names = [n for n, _ in models]
    if not models or len(set(names)) != len(names):
        raise ValueError(f'give at least one model, each name once; got {names}')
    for n, c in models:
        if '::' not in c and not osp.isfile(c):
            raise FileNotFoundError(f'config of model {n!r} not found: {c}')
        if not n.replace('-', '').replace('_', '').isalnum():
            raise ValueError(f'model name {n!r}: use letters, digits, - and _ (it names files)')
    fig_dir = fig_dir or osp.join(work_dir, 'figures')
    os.makedirs(work_dir, exist_ok=True)
    os.makedirs(fig_dir, exist_ok=True)
    progress = progress or Progress(osp.join(work_dir, 'progress.log'))
    study = dict(machine=machine(), settings=settings.key(),
                 started=time.strftime('%Y-%m-%d %H:%M:%S'), models=[])
    progress(f"{len(models)} model(s): {', '.join(names)}; {study['machine']['cpu']}, "
             f"{study['machine']['threads']} thread(s); work dir {work_dir}")
    for i, (name, config) in enumerate(models):
        runs = []
        for seed in settings.seeds:
            what = f'[{i + 1}/{len(models)}] {name}, seed {seed}'
            mdir = osp.join(work_dir, name, f'seed{seed}')
            cached = osp.join(mdir, 'result.json')
            run_settings = settings.for_run(name, seed)
            if settings.reuse and osp.isfile(cached):
                with open(cached) as f:
                    res = json.load(f)
                if res.get('settings') == run_settings.key() and \
                        res.get('config') == config and not res.get('errors'):
                    progress(f'{what}: reusing {cached} '
                             f"(computed {res['started']} to {res['finished']})")
                    runs.append(res)
                    continue
            progress(f'{what}: {config}')
            os.makedirs(mdir, exist_ok=True)
            res = study_model(name, config, mdir, run_settings, progress, fig_dir)
            atomic_write_text(json.dumps(res, indent=1), cached)
            if not res['errors'] and osp.isfile(osp.join(mdir, STAGES_FILE)):
                os.remove(osp.join(mdir, STAGES_FILE))   # reused as a whole from now on
            runs.append(res)
            progress(f"{what}: done in {res.get('seconds', 0):.0f}s")
        study['models'].append(aggregate(runs))
    loads = [v for res in study['models'] for _, v in res['load']]
    study['load_range'] = [min(loads), max(loads)] if loads else [0.0, 0.0]
    study['finished'] = time.strftime('%Y-%m-%d %H:%M:%S')
    study['figures'] = _figures(study['models'], fig_dir)
    study['errors'] = [f"{res['name']}: {e}" for res in study['models'] for e in res['errors']]
    study['outputs'] = [osp.join(work_dir, 'swap_study.json'),
                        osp.join(work_dir, 'swap_study.md')]
    with open(study['outputs'][0], 'w') as f:
        json.dump(study, f, indent=1)
    with open(study['outputs'][1], 'w') as f:
        f.write(markdown(study))
    return study
