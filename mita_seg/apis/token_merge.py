"""Token merging (ToMe) in the tools: ``--merge-ratio`` / ``--merge-ratios`` checked at
argument parsing, and :func:`merge_model` (:func:`mita_seg.merge_tokens` on a tool's model).

``--merge-ratio 0.3`` merges 30% of the grid tokens away before each attention and MLP of
every ViT encoder layer (and unmerges them after each), training-free; with ``--swap-attn
mita`` as well, layers on MiTA get their MLP merged only. A ratio outside ``[0, 0.5]`` is a
usage error (exit status 2); a model with nothing to merge ends the tool with one
``error:`` line (:class:`~mita_seg.models.NothingToMergeError`, a user error of
:func:`~mita_seg.apis.run_tool`).
"""
import argparse

from mita_seg.utils.cli import DeferredHelp

# torch, the mm stack and the models are imported where they are used: a tool builds its
# parser, and refuses a bad path or number, without importing them.

__all__ = ['merge_ratio', 'add_merge_args', 'merge_model', 'merge_label']


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


def merge_model(model, ratio: float, verbose: bool = True, **kwargs) -> int:
    """:func:`mita_seg.merge_tokens` on ``model`` (unwrapped from DDP).

    Returns:
        int: the number of encoder layers with merged tokens.

    Raises:
        NothingToMergeError: no layer to merge tokens in (the message lists the layers).
    """
    from mmengine.model import is_model_wrapper    # here: tools parse without the stack

    from mita_seg.models import merge_tokens
    if is_model_wrapper(model):
        model = model.module
    return merge_tokens(model, ratio, verbose=verbose, **kwargs)


def merge_label(ratio: float) -> str:
    """How tables name a ToMe setting."""
    return f'ToMe r={ratio:.2f}'
