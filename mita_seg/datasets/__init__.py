"""Generated datasets in ADE20K's layout: :mod:`.longrange_scenes`, scenes whose labels
need long-range evidence (``tools/dataset/make_longrange_ade20k.py`` writes them), and
:mod:`.ade_layout`, the file names the generators write and the check of an output folder."""
