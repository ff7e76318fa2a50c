"""What the analysis figures share: a title that fits its figure."""
import textwrap

__all__ = ['wrap_title']


def wrap_title(text: str, width_inches: float, fontsize: float = 9) -> str:
    """``text`` wrapped to lines that fit ``width_inches`` at ``fontsize`` points (a
    character of a sans-serif font is at most about 0.6 em wide): a figure's title whole,
    on as many lines as it needs (matplotlib cuts a long one at the figure's edge)."""
    chars = max(20, int(width_inches * 72 / (0.6 * fontsize)))
    return '\n'.join(textwrap.fill(line, chars) for line in text.split('\n'))
