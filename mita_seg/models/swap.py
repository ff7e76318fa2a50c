"""Swap the global attention of mmseg segmenters to MiTA, in place."""
from typing import List, Optional, Sequence, Tuple, Union

import torch.nn as nn
from mmengine.logging import print_log
from mmseg.models.decode_heads import SegmenterMaskTransformerHead

from mita_seg.setting import (DEFAULT_SETTING, SETTING_KEYS, SETTING_RULES, MiTASetting,
                              check_settings)
from mita_seg.utils.modules import is_attention_module
from .attention import (MiTASettingsMixin, can_use_mita, layer_indices,
                        swapped_attention_modules, use_dense, use_mita)
from .beit_attention import MiTABEiTAttention  # noqa: F401  (registers the BEiT/MAE swap)
from .grid import PATCH_EMBED_OWNERS
from .plan import PlanError, SwapPlan, attention_shape

# Attention modules this tool knows it cannot swap, by class name, and why.
_UNSWAPPABLE = {
    'WindowMSA': 'windowed attention (Swin): no global attention to replace',
    'ShiftWindowMSA': 'windowed attention (Swin): no global attention to replace',
    'EfficientMultiheadAttention': 'spatial-reduction attention (SegFormer/PVT)',
    'GlobalSubsampledAttention': 'spatial-reduction attention (Twins)',
    'LocallyGroupedSelfAttention': 'windowed attention (Twins)',
}


class NothingToSwapError(ValueError):
    """A model has no global attention MiTA can replace (the message lists what it has)."""


# The settings of swap_attention besides the MiTA ones: name -> (what it must be, check).
# (In Python, a tuple or a range of indices is a list too.)
SWAP_RULES = {
    'layers': ('None or a list of backbone layer indices, e.g. [0,1] or [-1]',
               lambda x: x is None or (isinstance(x, (list, tuple, range)) and all(
                   isinstance(i, int) and not isinstance(i, bool) for i in x))),
    'include_head': ('True or False', lambda x: isinstance(x, bool)),
}


def attention_layers(model: nn.Module) -> List[Tuple[str, nn.Module, int]]:
    """The global attention layers :func:`swap_attention` can put on MiTA (or already on
    MiTA), in the model's order: ``(name, owner, index)`` with ``name`` =
    ``<owner>.layers.<index>.attn`` (a backbone of the ViT family or BEiT/MAE, and
    Segmenter's mask head). The layer names a swap plan gives settings to."""
    out = []
    for owner_name, owner in model.named_modules():
        if isinstance(owner, (PATCH_EMBED_OWNERS, SegmenterMaskTransformerHead)):
            prefix = f'{owner_name}.' if owner_name else ''
            out += [(f'{prefix}layers.{i}.attn', owner, i) for i in range(len(owner.layers))
                    if can_use_mita(owner.layers[i].attn)]
    return out


def current_plan(model: nn.Module, ran: bool = False) -> SwapPlan:
    """What the attention layers of ``model`` run now, read from the modules: each layer's
    setting (None: dense attention). ``current_plan(model).describe()`` says it in one line
    (what ``tools/test.py`` prints).

    Args:
        model (nn.Module): a segmentor, backbone or head.
        ran (bool): each layer's setting as its forwards since its last change ran it, where
            that was one setting (:meth:`~mita_seg.models.attention.MiTASettingsMixin.
            setting_on`: fitted to a grid smaller than the pool, or to fewer tokens than
            ``k``); else as configured. Default: False.
    """
    layers = {}
    for name, _, _ in attention_layers(model):
        attn = model.get_submodule(name)
        if not isinstance(attn, MiTASettingsMixin):
            layers[name] = None
        elif ran and len(getattr(attn, 'ran_settings', ())) == 1:
            layers[name] = next(iter(attn.ran_settings))
        else:
            layers[name] = attn.setting
    return SwapPlan(layers)


def check_plan_fits(plan: SwapPlan, model: nn.Module, what: Optional[str] = None,
                    config: Optional[str] = None) -> List[Tuple[str, nn.Module, int]]:
    """Check ``plan`` against ``model``'s :func:`attention_layers`, their names and the
    shapes the plan records (:meth:`SwapPlan.check_fits`).

    Args:
        plan (SwapPlan): the plan.
        model (nn.Module): the model it is applied to.
        what (str, optional): the model, for messages. Default: its class name.
        config (str, optional): its config, for messages. Default: ``model.cfg``'s file
            (:func:`~mita_seg.apis.init_model` sets it), if any.

    Returns:
        list: ``model``'s :func:`attention_layers`.

    Raises:
        PlanError: the plan is for another model.
    """
    layers = attention_layers(model)
    if config is None:
        config = getattr(getattr(model, 'cfg', None), 'filename', None)  # init_model's
    plan.check_fits([name for name, _, _ in layers], what or type(model).__name__,
                    {name: attention_shape(owner.layers[i].attn) for name, owner, i in layers},
                    config if isinstance(config, str) else None)
    return layers


def _apply_plan(model: nn.Module, plan: SwapPlan) -> Tuple[List[str], dict]:
    """Put each layer of ``plan`` on its setting; returns the layers now on MiTA and the
    dense ones (name -> why, for the log)."""
    layers = check_plan_fits(plan, model)
    swapped, dense = [], {}
    for name, owner, i in layers:
        setting = plan.layers[name]
        if setting is None:
            try:
                use_dense(owner, [i])
            except ValueError as e:
                raise PlanError(f'{plan.what} puts {name} on dense attention: {e}') from None
            dense[name] = f'dense in {plan.what}'
        else:
            use_mita(owner, [i], setting)
            swapped.append(name)
    return swapped, dense


def swap_attention(model: nn.Module,
                   setting: Union[MiTASetting, str, dict, None] = None,
                   layers: Optional[Sequence[int]] = None,
                   include_head: bool = False,
                   verbose: bool = True,
                   plan: Optional[Union[SwapPlan, str]] = None,
                   **mita_cfg) -> int:
    """Replace the global attention of mmseg's ViT family by MiTA.

    Covers every ``VisionTransformer`` backbone (ViT, DeiT, Segmenter, SETR, DPT), whose
    attention becomes :class:`MiTAAttention`, BEiT and MAE backbones (their attention with
    a relative position bias becomes :class:`MiTABEiTAttention` /
    :class:`MiTAMAEAttention`, the bias going into MiTA) and, with ``include_head``,
    Segmenter's mask head. By default the encoder only, as the paper (and the authors'
    Segmenter code) swaps: Segmenter's 150 class embeddings are suffix tokens routed like
    patches, so each class query would read one expert's k keys and the shared expert
    where its mask needs evidence from the whole image (measured on the tiny Segmenter at
    N = 1025, one training run: +1.1 mIoU encoder only, -47 with the head; docs/swap.md).
    The swapped modules keep the very same parameter objects, so state-dict keys and
    weights are unchanged
    (:func:`~mita_seg.models.attention.use_mita`). Settings not given are the MiTA
    defaults (``pool_size=7, topk=49``) for modules swapped now, and keep their values in
    modules already on MiTA (so ``topk=16`` changes only k at test time). The grid shape
    reaches every swapped module through hooks on the token owners, for whole and slide
    inference alike.

    With ``plan`` (:class:`~mita_seg.models.plan.SwapPlan`, or the path of its JSON file),
    each attention layer (:func:`attention_layers`) gets its own whole setting, of any kind
    (the keys its entry leaves out at their defaults, on a layer already swapped too), or
    dense, which puts a swapped layer back on the standard attention it replaced.

    ``setting`` chooses the attention whole, as a user spells it
    (:meth:`~mita_seg.setting.MiTASetting.parse`: ``'7:49'``, ``'agent:7'``,
    ``'block:8:4'``, ``'topk:49'``, ``'window:7'``) or as a
    :class:`~mita_seg.setting.MiTASetting`; the other kinds of attention than MiTA are the
    paper's taxonomy, training-free on the same parameters (ViT family and Segmenter's head;
    BEiT/MAE take MiTA, top-k and window, the kinds their relative position bias enters).
    The setting is checked when it is made (single keys: every layer's new setting is made
    before the model changes) and travels whole: every layer swapped now holds that very
    object.

    Args:
        model (nn.Module): a segmentor, backbone or head; changed in place.
        setting (MiTASetting | str | dict, optional): the whole setting (its text, e.g.
            ``'7:49'``, or a dict of settings); not with ``mita_cfg``. Default: None
            (``mita_cfg`` over the defaults).
        layers (Sequence[int], optional): backbone encoder layers to swap (negative
            indices count from the end); None for all. Default: None.
        include_head (bool): swap Segmenter's mask head too (its attention modules already
            on MiTA are reconfigured only then). Default: False.
        verbose (bool): log what was swapped and what was left alone. Default: True.
        plan (SwapPlan | str, optional): per-layer settings (the head's too, where the
            plan names them); not with ``layers``, ``include_head`` or ``mita_cfg``.
            Default: None.
        **mita_cfg: single settings (``pool_size``, ``topk``, ``router_topk``,
            ``with_shared_expert``, ``shared_scale``, ``kind``, ``block_size``,
            ``num_blocks``, ``window``) over the defaults, or over the settings of modules
            already swapped.

    Returns:
        int: the number of attention modules now on MiTA.

    Raises:
        NothingToSwapError: nothing in ``model`` can be swapped (a ``ValueError`` whose
            message lists the attention modules found).
        PlanError: ``plan`` cannot be read, or does not fit the model (another layer count,
            a layer the model does not have, a layer of another width or head count than
            the plan records, dense for a layer built on MiTA).
        ValueError: ``layers`` names a layer that does not exist, or a setting is unknown
            or has a bad value.
    """
    setting = MiTASetting.of(setting)
    check_settings(dict(layers=layers, include_head=include_head), SWAP_RULES)
    if setting is not None and mita_cfg:
        raise ValueError(f'swap_attention: give a setting or single settings, not both; got '
                         f'{setting.text!r} and {sorted(mita_cfg)}')
    if setting is None:   # names and values refused before the model changes
        check_settings(mita_cfg, {k: SETTING_RULES[k] for k in SETTING_KEYS})
    swapped: List[str] = []
    left_by_choice = {}  # global attention not swapped because of layers= / include_head
    if plan is not None:
        if mita_cfg or setting is not None or layers is not None or include_head:
            raise ValueError('swap_attention: give a plan or settings (layers, include_head, '
                             f'MiTA settings), not both; got plan and {sorted(mita_cfg)}'
                             f'{" layers" if layers is not None else ""}'
                             f'{" include_head" if include_head else ""}')
        if isinstance(plan, str):
            plan = SwapPlan.load(plan)
        swapped, left_by_choice = _apply_plan(model, plan)
    else:
        targets = []   # (owner, the indices of its layers to swap)
        for owner_name, owner in model.named_modules():
            prefix = f'{owner_name}.' if owner_name else ''
            if isinstance(owner, PATCH_EMBED_OWNERS):
                n = len(owner.layers)
                ids = layer_indices(n, layers)
                left_by_choice.update({f'{prefix}layers.{i}.attn': f'not in layers={list(layers)}'
                                       for i in range(n) if i not in ids})
            elif isinstance(owner, SegmenterMaskTransformerHead):
                ids = range(len(owner.layers))
                if not include_head:
                    left_by_choice.update({f'{prefix}layers.{i}.attn': 'in a decode head '
                                           '(include_head=False)' for i in ids})
                    continue
            else:
                continue
            ids = [i for i in ids if can_use_mita(owner.layers[i].attn)]
            targets.append((owner, ids))
            swapped += [f'{prefix}layers.{i}.attn' for i in ids]
        # every layer's setting is made (or refused) before any layer changes: the whole
        # one, or the single keys over a swapped layer's own, over the defaults (made once)
        # for a layer swapped now
        fresh = setting
        planned = []
        for owner, ids in targets:
            for i in ids:
                attn = owner.layers[i].attn
                if setting is None and isinstance(attn, MiTASettingsMixin):
                    planned.append((owner, i, attn.setting.replace(**mita_cfg)))
                else:
                    fresh = fresh or DEFAULT_SETTING.replace(**mita_cfg)
                    planned.append((owner, i, fresh))
        for owner, i, new in planned:
            use_mita(owner, [i], new)

    on_mita = [name for name, _ in swapped_attention_modules(model)]
    skipped: List[Tuple[str, str]] = []
    for name, m in model.named_modules():
        if not is_attention_module(m) or isinstance(m, MiTASettingsMixin):
            continue
        if any(name.startswith(s + '.') for s in on_mita):
            continue  # the nn.MultiheadAttention holding a MiTA module's weights
        if any(name.startswith(s + '.') for s, _ in skipped):
            continue
        reason = left_by_choice.get(name) or _UNSWAPPABLE.get(
            type(m).__name__, 'not a global self-attention of a supported model (ViT family, '
            'BEiT/MAE, Segmenter head)')
        skipped.append((name, f'{type(m).__name__}: {reason}'))

    if not swapped and not (plan is not None and left_by_choice):
        found = '\n'.join(f'  {n} ({why})' for n, why in skipped) or '  none'
        raise NothingToSwapError(
            f'swap_attention found no global attention to swap to MiTA in '
            f'{type(model).__name__}. Attention modules found:\n{found}')
    if verbose:
        _log_swap(model, swapped, skipped, plan, left_by_choice, len(on_mita))
    return len(on_mita)


def _log_swap(model: nn.Module, swapped: List[str], skipped: List[Tuple[str, str]],
              plan: Optional[SwapPlan], left_by_choice: dict, on_mita: int) -> None:
    """Log what :func:`swap_attention` swapped (with a plan: how many layers on each
    setting, how many dense), the modules on MiTA that it left as they were, and what it
    left alone, and why."""
    if plan is not None:
        chosen = {}
        for name in swapped:
            label = model.get_submodule(name).setting.label
            chosen[label] = chosen.get(label, 0) + 1
        print_log(f'swap_attention: {plan.what}: {len(swapped)} attention modules on '
                  f'{plan.swapped_as()} ('
                  + ', '.join(f'{n} x {label}' for label, n in chosen.items())
                  + f'), {len(left_by_choice)} dense', logger='current')
        skipped = [(name, why) for name, why in skipped if name not in left_by_choice]
    else:
        setting = model.get_submodule(swapped[0]).setting
        kept = on_mita - len(swapped)
        print_log(f'swap_attention: {len(swapped)} attention modules on {setting.swap_name} '
                  f'({setting.cfg()})' + (f', {kept} more on MiTA as they were' if kept else ''),
                  logger='current')
    for name, why in skipped:
        print_log(f'swap_attention: left {name} alone: {why}', logger='current')
