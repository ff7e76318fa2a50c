"""The swap study (``tools/swap_study.py``, ``make swap-study``, docs/swap_study.md): train
standard-attention toys, swap them to MiTA without retraining, sweep, calibrate, fine-tune and
measure. :mod:`.settings` holds its settings and defaults (importing neither torch nor
mmengine: the command parses against them before the stack is loaded), :mod:`.cli` its
arguments; :mod:`.study` runs it, calling its stages in order on a
:class:`~.model_study.ModelStudy` (:mod:`.training`, :mod:`.sweep`, :mod:`.head`,
:mod:`.kinds`, :mod:`.plans`, :mod:`.finetune`, :mod:`.selection`, :mod:`.native`; the Runner
as they use it in :mod:`.runner`); :mod:`.rows` makes its rows and averages them over seeds
(:mod:`.stats`, a leaf); :mod:`.report` writes its tables, :mod:`.figures` its figures;
:mod:`.discrimination` is the long-range check. An experiment runner, not library code: it
uses :mod:`mita_seg.apis` as a user would, and parses its own arguments."""
from .settings import STUDY_CANDIDATES, StudySettings

__all__ = ['StudySettings', 'run_swap_study', 'STUDY_CANDIDATES']


def __getattr__(name):
    """``run_swap_study``, imported from :mod:`.study` (torch, mmengine) when first asked for."""
    if name == 'run_swap_study':
        from .study import run_swap_study
        return run_swap_study
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
