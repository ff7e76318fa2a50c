"""Token merging (ToMe) on the command line: ``--merge-ratio`` / ``--merge-ratios`` checked at
argument parsing (:func:`merge_ratio`, :func:`add_merge_args`).

``--merge-ratio 0.3`` merges 30% of the grid tokens away before each attention and MLP of
every ViT encoder layer (and unmerges them after each), training-free
(:func:`~mita_seg.apis.merge_model`); with ``--swap-attn`` as well, layers on MiTA get their
MLP merged only. A ratio outside ``[0, 0.5]`` is a usage error (exit status 2); a model with
nothing to merge ends the tool with one ``error:`` line
(:class:`~mita_seg.models.NothingToMergeError`, a user error of :func:`run_tool`).
"""
import argparse

from .core import DeferredHelp

# mita_seg.ops.token_merge (torch) is imported where it is used: a tool builds its parser,
# and refuses a bad path or number, without importing torch.

__all__ = ['merge_ratio', 'add_merge_args']


def merge_ratio(text: str) -> float:
    """argparse ``type`` of a merge ratio: a number in ``[0, 0.5]``."""
    from mita_seg.ops.token_merge import MAX_MERGE_RATIO, check_ratio
    try:
        return check_ratio(float(text))
    except ValueError as e:
        msg = str(e) if 'outside' in str(e) else (
            f'{text!r} is not a number: give the fraction of grid tokens merged, in '
            f'[0, {MAX_MERGE_RATIO}], e.g. 0.3')
        raise argparse.ArgumentTypeError(msg) from None


def add_merge_args(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    """Add ``--merge-ratio R`` (or, with ``sweep``, ``--merge-ratios R [R ...]``) to a
    tool: token merging (ToMe, :func:`mita_seg.merge_tokens`) at that ratio."""
    def what() -> str:
        from mita_seg.ops.token_merge import MAX_MERGE_RATIO
        return ('fraction of the grid tokens ToMe merges away before each attention and MLP '
                'of every ViT encoder layer (training-free; unmerged after each), in '
                f'[0, {MAX_MERGE_RATIO}]')

    if sweep:
        parser.add_argument('--merge-ratios', type=merge_ratio, nargs='+', default=[],
                            metavar='R', help=DeferredHelp(
                                lambda: f'also evaluate token merging (ToMe) at each R: '
                                f'{what()}'))
    else:
        parser.add_argument('--merge-ratio', type=merge_ratio, default=None, metavar='R',
                            help=DeferredHelp(
                                lambda: f'token merging (ToMe): {what()}. With --swap-attn '
                                'mita, layers on MiTA get their MLP merged only'))
