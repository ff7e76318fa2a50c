"""Token merging (ToMe) on a tool's model: :func:`merge_model` (:func:`mita_seg.merge_tokens`,
unwrapped from DDP) and the label tables give a ToMe setting (:func:`merge_label`).

``merge_model(model, 0.3)`` merges 30% of the grid tokens away before each attention and MLP
of every ViT encoder layer (and unmerges them after each), training-free; layers on MiTA get
their MLP merged only. A model with nothing to merge is a
:class:`~mita_seg.models.NothingToMergeError`. The command line's ``--merge-ratio`` is in
the tools' command-line package (``cli/merge_args.py``), which imports this, never the
reverse.
"""
# torch, the mm stack and the models are imported where they are used.

__all__ = ['merge_model', 'merge_label']


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
