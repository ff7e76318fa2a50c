"""Generated datasets in ADE20K's layout: :mod:`.longrange_scenes`, scenes whose labels
need long-range evidence (``tools/dataset/make_longrange_ade20k.py`` writes them)."""
