"""What the analysis figures share: a title that fits its figure, and a figure written whole."""
import os.path as osp
import textwrap

from mita_seg.utils.atomic_files import atomic_path

__all__ = ['wrap_title', 'save_figure']


def wrap_title(text: str, width_inches: float, fontsize: float = 9) -> str:
    """``text`` wrapped to lines that fit ``width_inches`` at ``fontsize`` points (a
    character of a sans-serif font is at most about 0.6 em wide): a figure's title whole,
    on as many lines as it needs (matplotlib cuts a long one at the figure's edge)."""
    chars = max(20, int(width_inches * 72 / (0.6 * fontsize)))
    return '\n'.join(textwrap.fill(line, chars) for line in text.split('\n'))


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Write the matplotlib figure ``fig`` to ``path`` whole, in the format its extension
    names (``.png``, ``.pdf``, ``.svg``...): rendered into a temporary file beside it, which
    then replaces ``path`` in one rename, with the mode a new file gets from the umask
    (:func:`mita_seg.utils.atomic_files.atomic_path`); a failed or killed save leaves the file
    that was there. Returns ``path``."""
    ext = osp.splitext(path)[1].lower()
    with atomic_path(path, suffix=ext or '.png') as tmp:
        fig.savefig(tmp, dpi=dpi, format=ext[1:] or 'png')
    return path
