"""The swap study (``tools/swap_study.py``, ``make swap-study``, docs/swap_study.md): train
standard-attention toys, swap them to MiTA without retraining, sweep, calibrate, fine-tune and
measure. :mod:`.study` runs it (settings, stages, the run), :mod:`.report` writes its tables
and figures. An experiment runner, not library code: it uses :mod:`mita_seg.apis` as a user
would."""
from .study import STUDY_CANDIDATES, StudySettings, run_swap_study

__all__ = ['StudySettings', 'run_swap_study', 'STUDY_CANDIDATES']
