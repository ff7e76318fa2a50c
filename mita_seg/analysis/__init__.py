"""Analysis tools of mita_seg (token selection of MiTA experts, FLOP counts).

Submodules are imported on use (``from mita_seg.analysis.token_selection import ...``), so
``import mita_seg.analysis`` stays light and needs no mmseg.
"""
