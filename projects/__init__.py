"""Experiments built on mita_seg, outside the library (mmseg's ``projects/`` convention):
each folder is run by its command in ``tools/`` from the repository root."""
