"""Which tokens MiTA's routed experts select: the emergent token-pruning effect.

Each routed expert ``m`` reads the ``k`` keys ``I_m`` with the largest landmark scores
``S[m] = R_m K^T``; a token in no ``I_m`` is read by no routed expert (only, through the
shared expert, as part of the pooled values). :class:`TokenSelectionRecorder` hooks every
:class:`~mita_seg.models.MiTAAttention` of a model, recomputes ``q, k`` from the layer input
and ``attn.in_proj_weight`` exactly as the layer does, and takes the routing decisions from
:func:`mita_seg.ops.mita_routing`, the function every MiTA backend routes with. Global tokens
(a swapped Segmenter head's class tokens) are left out of a layer's record: every query reads
them, and the experts route over the other tokens, as the layer runs.

Example::

    swap_attention(model, pool_size=7, topk=49)
    with TokenSelectionRecorder(model) as recorder:
        model.test_step(data)
    for rec in recorder.records:
        print(rec.name, rec.frac_never_selected)
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn

from mita_seg.ops import mita_routing
from mita_seg.ops.bias import landmark_bias
from mita_seg.ops.global_tokens import split_tokens
from mita_seg.ops.routing import pair
from mita_seg.utils.errors import InputError
from .plotting import save_figure, wrap_title


def selection_from_qk(q: torch.Tensor,
                      k: torch.Tensor,
                      hw_shape: Tuple[int, int],
                      pool_size,
                      topk: int,
                      router_topk: int = 1,
                      num_prefix_tokens: int = 1,
                      rel_pos_bias=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keys selected by MiTA's routed experts, from ``q, k`` (``[B, H, N, d]``).

    Args:
        q, k (Tensor): queries and keys after the head split.
        hw_shape (tuple[int, int]): the patch grid.
        pool_size (int | tuple[int, int]): landmark grid, ``M = Ph * Pw`` experts.
        topk (int): keys per expert (clamped to N).
        router_topk (int): experts per query. Default: 1.
        num_prefix_tokens (int): tokens before the grid. Default: 1.
        rel_pos_bias (RelPosBias, optional): BEiT's relative position bias, which steers
            the landmark scores (:func:`mita_seg.ops.bias.landmark_bias`). Default: None.

    Returns:
        tuple[Tensor, Tensor]: ``selected`` and ``used``, bool ``[B, H, N]``: the key is in
        the top-k set of at least one expert (``selected``), of at least one expert that
        some query is routed to (``used``: the keys the routed softmax reads).
    """
    B, H, N, _ = q.shape
    pool_size = pair(pool_size, 'pool_size')
    biases = None if rel_pos_bias is None else landmark_bias(rel_pos_bias, pool_size)
    rt = mita_routing(q, k, tuple(hw_shape), pool_size, min(topk, N), router_topk,
                      num_prefix_tokens, landmark_bias=biases)
    keys = rt.expert_keys.flatten(2)                                   # [B, H, M*k]
    M = rt.expert_keys.shape[2]
    routed = torch.zeros(B, H, M, dtype=torch.bool, device=q.device)
    routed.scatter_(-1, rt.choice.flatten(2), True)                    # experts with queries
    selected = torch.zeros(B, H, N, dtype=torch.bool, device=q.device)
    selected.scatter_(-1, keys, True)
    weight = routed.unsqueeze(-1).expand_as(rt.expert_keys).flatten(2).float()
    used = torch.zeros(B, H, N, device=q.device).scatter_add_(-1, keys, weight) > 0
    return selected, used


@dataclass
class LayerSelection:
    """Token selection of one call of one MiTA layer.

    Attributes:
        name (str): the module name in the model.
        hw_shape (tuple[int, int]): the patch grid of this call.
        num_prefix_tokens (int): tokens before the grid (cls) that are not global.
        num_experts (int): ``M``.
        topk (int): keys per expert used (clamped to the routed tokens).
        selected (Tensor): bool ``[B, H, N]`` over the ``N`` routed tokens (the global ones
            left out), selected by at least one routed expert.
        used (Tensor): bool ``[B, H, N]``, selected by an expert at least one query reads.
    """
    name: str
    hw_shape: Tuple[int, int]
    num_prefix_tokens: int
    num_experts: int
    topk: int
    selected: torch.Tensor
    used: torch.Tensor

    @property
    def frac_never_selected(self) -> float:
        """Fraction of (image, head, token) triples selected by no routed expert; all
        N tokens (prefix, grid and suffix) count."""
        return 1.0 - self.selected.float().mean().item()

    @property
    def frac_never_used(self) -> float:
        """As :attr:`frac_never_selected`, counting only experts some query is routed to."""
        return 1.0 - self.used.float().mean().item()

    def per_head_never_selected(self) -> torch.Tensor:
        """``[H]``: fraction of tokens selected by no routed expert, per head."""
        return 1.0 - self.selected.float().mean(dim=(0, 2))

    def grid_map(self, which: str = 'selected') -> torch.Tensor:
        """``[B, H, h, w]`` bool map of the grid tokens (``which``: selected / used)."""
        if which not in ('selected', 'used'):
            raise ValueError(f"which must be 'selected' or 'used', got {which!r}")
        mask = getattr(self, which)
        h, w = self.hw_shape
        p = self.num_prefix_tokens
        return mask[:, :, p:p + h * w].reshape(*mask.shape[:2], h, w)


class TokenSelectionRecorder:
    """Context manager recording :class:`LayerSelection` for every MiTA layer call.

    Only layers on MiTA are recorded: a swapped module of another kind (``agent:7``,
    ``block:8:4``, ``topk:49``, ``window:7``) has no routed experts to select tokens, and
    is left out (also when it is configured so after the recorder was made).

    Args:
        model (nn.Module): a model with MiTA attention modules (``MiTAAttention``,
            ``MiTABEiTAttention``; build it with MiTA, or call
            :func:`mita_seg.swap_attention` first).
        layers (Sequence[str], optional): module names to record; None for all.

    Raises:
        InputError: (a ``ValueError``) the model has no attention on MiTA (or none of
            ``layers``).
    """

    def __init__(self, model: nn.Module, layers: Optional[Sequence[str]] = None):
        from mita_seg.models import MiTASettingsMixin
        swapped = {n: m for n, m in model.named_modules()
                   if isinstance(m, MiTASettingsMixin) and (layers is None or n in layers)}
        self.modules = {n: m for n, m in swapped.items() if m.setting.is_mita}
        if not self.modules:
            others = sorted({m.setting.kind for m in swapped.values()})
            raise InputError(
                f'{type(model).__name__} has no MiTA attention modules'
                + (f' named {list(layers)}' if layers is not None else '')
                + (f' (its swapped attention is {", ".join(others)}, which has no routed '
                   'experts to select tokens)' if others else '')
                + ': swap its attention to MiTA first (mita_seg.swap_attention, e.g. 7:49)')
        self.records: List[LayerSelection] = []
        self._handles = []

    def __enter__(self) -> 'TokenSelectionRecorder':
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(
                self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):

        def hook(module, args, kwargs):
            if not module.setting.is_mita:   # configured to another kind since
                return
            query = args[0] if args else kwargs['query']
            self.records.append(_layer_selection(name, module, query, kwargs))

        return hook

    def by_layer(self) -> Dict[str, List[LayerSelection]]:
        """Records grouped by module name, in call order."""
        out: Dict[str, List[LayerSelection]] = {}
        for rec in self.records:
            out.setdefault(rec.name, []).append(rec)
        return out

    def never_selected(self) -> Dict[str, float]:
        """Per layer, the fraction of tokens selected by no routed expert, averaged over
        every recorded call (weighted by tokens)."""
        out = {}
        for name, recs in self.by_layer().items():
            total = sum(r.selected.numel() for r in recs)
            out[name] = 1.0 - sum(r.selected.sum().item() for r in recs) / total
        return out


@torch.no_grad()
def _layer_selection(name: str, module: nn.Module, query: torch.Tensor,
                     kwargs: dict) -> LayerSelection:
    """Recompute the routing of ``module`` (a MiTA attention module) on its input
    ``query``, as its ``forward`` does."""
    from mita_seg.models import MiTABEiTAttention
    bias, global_tokens = None, (0, 0)
    if isinstance(module, MiTABEiTAttention):
        q, k, _, (h, w), p = module.project(query)
        bias = module.rel_pos_bias()
    else:
        if kwargs.get('query_pos') is not None:
            query = query + kwargs['query_pos']
        if not module.batch_first:
            query = query.transpose(0, 1)
        q, k, _, (h, w), p = module.project(query, kwargs.get('hw_shape'))
        global_tokens = module.global_tokens_of(q.shape[2], (h, w), kwargs.get('global_tokens'))
    if any(global_tokens):   # every query reads them; the experts route over the others
        (q, _), (k, _) = split_tokens(q, global_tokens), split_tokens(k, global_tokens)
        p -= global_tokens[0]
    s = module.setting_on(q.shape[2], (h, w), record=False)
    selected, used = selection_from_qk(q, k, (h, w), s.pool, s.topk, s.router_topk, p, bias)
    return LayerSelection(name, (h, w), p, s.num_experts, s.topk, selected.cpu(), used.cpu())


def experts_label(records: Sequence[LayerSelection]) -> str:
    """The routed experts of ``records`` in words, for a title: ``M=16, k=16``, or each
    value the layers ran with where they differ (a swap plan, a head whose class tokens
    leave fewer keys): ``M=16/49, k=16/49 (by layer)``."""
    ms = sorted({r.num_experts for r in records})
    ks = sorted({r.topk for r in records})
    text = f'M={"/".join(map(str, ms))}, k={"/".join(map(str, ks))}'
    return text + (' (by layer)' if len(ms) > 1 or len(ks) > 1 else '')


def network_image(data_preprocessor, inputs: torch.Tensor) -> np.ndarray:
    """The network input ``[3, H, W]`` as a uint8 RGB image (normalisation undone)."""
    img = inputs.float()
    if getattr(data_preprocessor, '_enable_normalize', True):
        img = img * data_preprocessor.std + data_preprocessor.mean
    img = img.clamp(0, 255).byte().permute(1, 2, 0).cpu().numpy()
    if not getattr(data_preprocessor, 'channel_conversion', False):
        img = img[..., ::-1]                                # BGR as loaded -> RGB
    return np.ascontiguousarray(img)


def record_image(model: nn.Module, img) -> Tuple[List[LayerSelection], np.ndarray]:
    """Run mmseg's ``inference_model`` on one image and record every MiTA layer.

    Args:
        model (nn.Module): a segmentor with MiTA attention and ``cfg`` (from
            :func:`mita_seg.apis.init_model`); set ``model.test_cfg.mode='whole'`` for one
            grid per image, aligned with the input.
        img (str | np.ndarray): the image.

    Returns:
        tuple: the records (one per layer, in call order) and the network input as an RGB
        uint8 image.
    """
    from mmseg.apis import inference_model
    inputs = []
    handle = model.backbone.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    try:
        with TokenSelectionRecorder(model) as recorder:
            inference_model(model, img)
    finally:
        handle.remove()
    records = [recs[0] for recs in recorder.by_layer().values()]
    return records, network_image(model.data_preprocessor, inputs[0][0])


def plot_selection_overlay(image,
                           records: Sequence[LayerSelection],
                           out_file: str,
                           index: int = 0,
                           which: str = 'selected',
                           cell_size: Optional[Tuple[float, float]] = None,
                           title: Optional[str] = None,
                           dpi: int = 100) -> str:
    """Save a grid of layers, each the selection map over ``image``.

    The first cell shows the input; each further cell colours a grid token by the fraction
    of heads in which some routed expert selects it (dark: selected in no head), and its
    title gives the layer's fraction of (head, token) pairs never selected in this image
    (all N tokens, class/cls tokens included).

    Args:
        image (np.ndarray): the network input, ``[h_img, w_img, 3]`` uint8 RGB.
        records (Sequence[LayerSelection]): one record per layer (one call each).
        out_file (str): PNG path.
        index (int): the image's index in the recorded batch. Default: 0.
        which (str): 'selected' or 'used'. Default: 'selected'.
        cell_size (tuple[float, float], optional): input pixels per grid token (the patch
            size); None stretches the grid over the image. Default: None.
        title (str, optional): figure title.
        dpi (int): resolution of the PNG. Default: 100.

    Returns:
        str: ``out_file``.
    """
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError('no records to plot: did the model run any MiTA layer?')
    n = len(records) + 1                                  # the input, then one per layer
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    H, W = image.shape[:2]
    fig, axes = plt.subplots(rows, cols, squeeze=False, layout='constrained',
                             figsize=(2.6 * cols + 1.0, 2.6 * rows * H / W + 0.6))
    for ax in axes.flat:
        ax.axis('off')
    axes.flat[0].imshow(image)
    axes.flat[0].set_title('input', fontsize=8)
    for ax, rec in zip(axes.flat[1:], records):
        freq = rec.grid_map(which)[index].float().mean(0).numpy()      # [h, w] in [0, 1]
        never = 1.0 - getattr(rec, which)[index].float().mean().item()
        h, w = rec.hw_shape
        ch, cw = cell_size if cell_size is not None else (H / h, W / w)
        ax.imshow(image, extent=(0, W, H, 0))
        im = ax.imshow(freq, cmap='magma', vmin=0, vmax=1, alpha=0.6,
                       extent=(0, w * cw, h * ch, 0), interpolation='nearest')
        ax.set_xlim(0, W)
        ax.set_ylim(H, 0)
        ax.set_title(f'{rec.name}\nnever {which}: {100 * never:.0f}%', fontsize=8)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8,
                 label=f'fraction of heads in which\nthe token is {which}')
    if title:   # whole, wrapped to the figure's width
        fig.suptitle(wrap_title(title, fig.get_figwidth()), fontsize=9)
    save_figure(fig, out_file, dpi)
    plt.close(fig)
    return out_file
