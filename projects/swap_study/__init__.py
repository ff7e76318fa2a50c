"""The swap study (``tools/swap_study.py``, ``make swap-study``, docs/swap_study.md): train
standard-attention toys, swap them to MiTA without retraining, sweep, calibrate, fine-tune and
measure. :mod:`.settings` holds its settings and defaults (importing neither torch nor
mmengine: the command parses against them before the stack is loaded), :mod:`.study` runs it
(its stages and the run), :mod:`.report` writes its tables and figures. An experiment runner,
not library code: it uses :mod:`mita_seg.apis` as a user would."""
from .settings import STUDY_CANDIDATES, StudySettings

__all__ = ['StudySettings', 'run_swap_study', 'STUDY_CANDIDATES']


def __getattr__(name):
    """``run_swap_study``, imported from :mod:`.study` (torch, mmengine) when first asked for."""
    if name == 'run_swap_study':
        from .study import run_swap_study
        return run_swap_study
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
