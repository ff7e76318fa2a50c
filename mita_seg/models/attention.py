"""``MiTAAttention``: mmcv's ``MultiheadAttention`` with MiTA as its attention (its settings'
defaults and rules are those of :mod:`mita_seg.setting`, re-exported here), and
:func:`use_mita`, which puts given layers of a token owner on MiTA (the low-level
replacement the MiTA backbone, the MiTA head and :func:`mita_seg.swap_attention` share)."""
import inspect
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmengine.logging import print_log
from mmseg.registry import MODELS

from mita_seg.ops import attend, operator_of
from mita_seg.setting import (DEFAULT_SETTING, KINDS, MITA_DEFAULTS, MITA_KEYS,  # noqa: F401
                              SETTING_DEFAULTS,
                              SETTING_KEYS, SETTING_RULES, MiTASetting, MiTASettingError,
                              check_settings)
from .grid import GridContext, grid_context, resolve_grid


class MiTASettingsMixin:
    """The setting of a swapped attention module: one frozen
    :class:`~mita_seg.setting.MiTASetting` (:attr:`setting`: the kind of attention and its
    settings), changed whole (:meth:`configure`), read by key (``module.topk``,
    ``module.kind``...), fitted to the grid of a forward (:meth:`setting_on`), and its repr.
    Shared by every MiTA attention module (:class:`MiTAAttention`, the BEiT/MAE ones).
    """
    # the kinds of attention (mita_seg.setting.KINDS) the module can run
    supported_kinds: Tuple[str, ...] = tuple(KINDS)
    setting: MiTASetting

    def configure(self, setting: Union[MiTASetting, str, dict, None] = None,
                  **settings) -> None:
        """Change the setting, e.g. M and k at test time: a whole ``setting`` (a
        MiTASetting, its text or a dict of settings, the keys it leaves out at their
        defaults: :meth:`MiTASetting.of`), or single keys (:data:`SETTING_KEYS`) over the
        module's own.

        Raises:
            ValueError: an unknown setting, a bad value, a key its kind does not read, or a
                kind this module cannot run.
        """
        setting = MiTASetting.of(setting)
        if setting is not None and settings:
            raise MiTASettingError(f'configure: give a whole setting or single keys, not both; '
                                   f'got {setting.text!r} and {", ".join(sorted(settings))}')
        if setting is None:  # single keys over the module's own (or the defaults)
            setting = getattr(self, 'setting', DEFAULT_SETTING).replace(**settings)
        if setting.kind not in self.supported_kinds:
            raise MiTASettingError(
                f'{type(self).__name__} runs {", ".join(self.supported_kinds)} attention, not '
                f'{setting.kind}: {KINDS[setting.kind].title} does not take its relative '
                'position bias; give it a MiTA setting (e.g. 7:49)')
        operator_of(setting)   # imported now, not in a (compiled) forward
        self.__dict__['setting'] = setting
        self.__dict__['ran_settings'] = set()   # what eager forwards ran with since

    def setting_on(self, num_tokens: int, hw_shape: Tuple[int, int],
                   record: bool = True) -> MiTASetting:
        """The setting a forward over ``num_tokens`` keys on a ``hw_shape`` grid runs with
        (:meth:`~mita_seg.setting.MiTASetting.fit`: the landmark grid at most the patch
        grid, ``k`` at most ``N``, ``router_topk`` at most ``M``, as mmseg's ViT runs on any
        image of at least one patch). A reduction is logged once per setting, by an eager
        forward (a ``torch.compile``'d one skips the log rather than break its graph); eager
        forwards add what they ran with to ``ran_settings`` (``record=False``: a caller
        that only asks, as the analysis of token selection does)."""
        asked = self.setting
        if torch.jit.is_tracing():   # a jit trace (FLOP counting) sees sizes as tensors
            with warnings.catch_warnings():
                warnings.simplefilter('ignore', torch.jit.TracerWarning)
                num_tokens, hw_shape = int(num_tokens), tuple(int(s) for s in hw_shape)
        ran = asked.fit(hw_shape, num_tokens)
        if record and not torch.compiler.is_compiling() and not torch.jit.is_tracing():
            self.__dict__.setdefault('ran_settings', set()).add(ran)   # current_plan(ran=)
        if ran == asked:
            return asked
        if not torch.compiler.is_compiling():   # no graph break for a log line
            h, w = hw_shape
            why = []   # each setting reduced, and why
            if ran.pool != asked.pool:
                why.append(f'pool_size {asked.pool} -> {ran.pool}: the grid is {h}x{w}')
            if ran.topk != asked.topk:
                why.append(f'topk {asked.topk} -> {ran.topk}: there are N={num_tokens} tokens')
            if ran.router_topk != asked.router_topk:
                why.append(f'router_topk {asked.router_topk} -> {ran.router_topk}: there are '
                           f'M={ran.num_experts} landmarks')
            _log_once(f'{type(self).__name__} on a {h}x{w} grid (N={num_tokens} tokens) runs '
                      f'with fewer: {"; ".join(why)} (logged once)', asked, ran)
        return ran

    def extra_repr(self) -> str:
        return ', '.join(f'{k}={v}' for k, v in {
            **({} if self.setting.is_mita else {'kind': self.setting.kind}),
            **self.setting.cfg()}.items())


def _setting_key(key: str) -> property:
    return property(lambda self: getattr(self.setting, key),
                    doc=f'``setting.{key}`` (read-only: :meth:`configure` changes it)')


for _key in SETTING_KEYS:   # module.topk, module.kind...: the setting's
    setattr(MiTASettingsMixin, _key, _setting_key(_key))


@MODELS.register_module()
class MiTAAttention(MiTASettingsMixin, MultiheadAttention):
    """Mixture-of-Top-k Attention, a drop-in replacement for mmcv's ``MultiheadAttention``.

    It keeps mmcv's parameters (``attn.in_proj_weight`` ``[3C, C]``, ``attn.in_proj_bias``,
    ``attn.out_proj.{weight,bias}``), so state dicts load both ways with ``strict=True``;
    only the attention between the projections changes (:func:`mita_seg.ops.mita_attention`).

    Args:
        embed_dims (int): The embedding dimension ``C``.
        num_heads (int): Parallel attention heads ``H``.
        pool_size (int | tuple[int, int]): landmark grid, ``M = Ph * Pw`` experts.
            Default: 7.
        topk (int): keys per routed expert. Default: 49.
        router_topk (int): experts per query. Default: 1.
        with_shared_expert (bool): use the shared (compression) expert; False is
            route-only MiTA. Default: True.
        shared_scale (float, optional): scale of the shared logits, None for ``1 / d``.
            Default: None.
        kind (str): the attention (:data:`~mita_seg.setting.KINDS`): ``'mita'``, or a
            training-free alternative of the paper's taxonomy on the same parameters:
            ``'agent'`` (compression only: ``pool_size``, ``shared_scale``), ``'block'``
            (block routing: ``block_size``, ``num_blocks``), ``'topk'`` (per-query top-k:
            ``topk``), ``'window'`` (a local window: ``window``); those treat the tokens
            off the grid as global. Default: 'mita'.
        block_size (int): block side, in grid tokens (``kind='block'``). Default: 8.
        num_blocks (int): blocks each query attends to, its own included (``kind='block'``).
            Default: 4.
        window (int): window side, in grid tokens (``kind='window'``). Default: 7.
        setting (MiTASetting | str | dict, optional): the whole setting instead of the
            keys above (which are then left at their defaults): a MiTASetting, its text
            (``'7:49'``) or a dict of settings. Default: None.
        with_dwc (bool): add a depthwise 3x3 conv of the grid values to the output before
            the projection (adds ``dwc.{weight,bias}``). Default: False.
        num_prefix_tokens (int): tokens before the grid when no grid context says
            otherwise (1 for a ViT cls token). Default: 1.
        attn_drop (float): dropout on attention weights. MiTA has no dense weight matrix
            to drop from: values > 0 are accepted for swapped models but not applied.
            Default: 0.
        proj_drop (float): dropout after the output projection. Default: 0.
        dropout_layer (dict, optional): residual dropout, as mmcv's. Default: Dropout(0).
        qkv_bias (bool): bias of the q, k, v projection. Default: True.
        batch_first (bool): tokens as ``[B, N, C]`` (True) or ``[N, B, C]``. Default: True.
        init_cfg (dict, optional): initialization config. Default: None.
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 pool_size: Union[int, Tuple[int, int]] = 7,
                 topk: int = 49,
                 router_topk: int = 1,
                 with_shared_expert: bool = True,
                 shared_scale: Optional[float] = None,
                 kind: str = 'mita',
                 block_size: int = 8,
                 num_blocks: int = 4,
                 window: int = 7,
                 with_dwc: bool = False,
                 setting: Union[MiTASetting, str, dict, None] = None,
                 num_prefix_tokens: int = 1,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 dropout_layer: Optional[dict] = None,
                 qkv_bias: bool = True,
                 batch_first: bool = True,
                 init_cfg: Optional[dict] = None,
                 **kwargs):
        if 'bias' in kwargs:  # the name mmseg's TransformerEncoderLayer passes
            qkv_bias = kwargs.pop('bias')
        unknown = sorted(kwargs.keys() - _TORCH_MHA_ARGS)
        if unknown:  # else nn.MultiheadAttention's TypeError, two classes down
            raise TypeError(
                f'MiTAAttention got unexpected keyword argument(s) {", ".join(unknown)}; its '
                f'settings are {", ".join(SETTING_KEYS)}, with_dwc and setting (and mmcv '
                "MultiheadAttention's arguments)")
        if dropout_layer is None:
            dropout_layer = dict(type='Dropout', drop_prob=0.)
        if embed_dims % num_heads:
            raise ValueError(f'embed_dims={embed_dims} is not divisible by num_heads={num_heads}')
        super().__init__(embed_dims, num_heads, attn_drop=attn_drop, proj_drop=proj_drop,
                         dropout_layer=dropout_layer, init_cfg=init_cfg,
                         batch_first=batch_first, bias=qkv_bias, **kwargs)
        if attn_drop > 0:
            warnings.warn(f'MiTAAttention does not apply attn_drop={attn_drop} (no dense '
                          'attention matrix); proj_drop and dropout_layer still apply')
        if not isinstance(with_dwc, bool):  # the message of the rule
            check_settings(dict(with_dwc=with_dwc))
        keys = dict(pool_size=pool_size, topk=topk, router_topk=router_topk,
                    with_shared_expert=with_shared_expert, shared_scale=shared_scale, kind=kind,
                    block_size=block_size, num_blocks=num_blocks, window=window)
        off = [k for k, v in keys.items() if v != SETTING_DEFAULTS[k]]
        setting = MiTASetting.of(setting)
        if setting is not None and off:
            raise MiTASettingError(f'MiTAAttention: give a setting or single keys, not both; '
                                   f'got setting={setting.text!r} and {", ".join(off)}')
        self.configure(setting or MiTASetting(pool_size, topk, router_topk, with_shared_expert,
                                              shared_scale, kind, block_size, num_blocks,
                                              window))
        self.num_prefix_tokens = num_prefix_tokens
        self.grid: Optional[GridContext] = None
        self.dwc = nn.Conv2d(embed_dims, embed_dims, 3, padding=1,
                             groups=embed_dims) if with_dwc else None

    @classmethod
    def from_mmcv(cls, attn: MultiheadAttention, setting: MiTASetting,
                  with_dwc: bool = False) -> 'MiTAAttention':
        """A MiTAAttention with ``setting`` that takes over the very modules (and so the
        parameters) of an mmcv ``MultiheadAttention``."""
        mha = attn.attn
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError('only self-attention with packed q/k/v projections can be '
                             'swapped to MiTA')
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            new = cls(attn.embed_dims, attn.num_heads, attn_drop=mha.dropout,
                      batch_first=attn.batch_first, qkv_bias=mha.in_proj_bias is not None,
                      init_cfg=attn.init_cfg, with_dwc=with_dwc, setting=setting)
        new.attn, new.proj_drop, new.dropout_layer = mha, attn.proj_drop, attn.dropout_layer
        new.train(attn.training)
        return new

    def token_layout(self, num_tokens: int, hw_shape: Optional[Tuple[int, int]] = None
                     ) -> Tuple[Tuple[int, int], int]:
        """The grid ``(h, w)`` and number of prefix tokens of a forward over ``num_tokens``
        tokens: ``hw_shape`` if given, else the grid context, else a square."""
        if self.grid is not None:
            p, hw_shape = self.grid.num_prefix_tokens, hw_shape or self.grid.hw_shape
        else:
            p = self.num_prefix_tokens
        return resolve_grid(num_tokens, p, hw_shape), p

    def global_tokens_of(self, num_tokens: int, hw_shape: Tuple[int, int],
                         given: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
        """The ``(prefix, suffix)`` global tokens of a forward over ``num_tokens`` tokens on
        a ``hw_shape`` grid: ``given`` (its ``global_tokens``), else the grid context's (a
        swapped Segmenter head's class tokens), else none."""
        if given is not None:
            return given
        return (0, 0) if self.grid is None else self.grid.global_tokens(num_tokens, hw_shape)

    def project(self, query: torch.Tensor, hw_shape: Optional[Tuple[int, int]] = None):
        """Heads and grid of ``query`` (``[B, N, C]``, batch first).

        Returns:
            tuple: ``q, k, v`` (``[B, H, N, d]``), the grid ``(h, w)`` (``hw_shape``, else the
            grid context, else a square) and the number of prefix tokens.
        """
        B, N, C = query.shape
        (h, w), p = self.token_layout(N, hw_shape)
        qkv = F.linear(query, self.attn.in_proj_weight, self.attn.in_proj_bias)
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(
            2, 0, 3, 1, 4).unbind(0)                                    # [B, H, N, d]
        return q, k, v, (h, w), p

    def forward(self,
                query: torch.Tensor,
                key: Optional[torch.Tensor] = None,
                value: Optional[torch.Tensor] = None,
                identity: Optional[torch.Tensor] = None,
                query_pos: Optional[torch.Tensor] = None,
                key_pos: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None,
                hw_shape: Optional[Tuple[int, int]] = None,
                global_tokens: Optional[Tuple[int, int]] = None,
                **kwargs) -> torch.Tensor:
        """Self-attention of ``query`` (``[B, N, C]`` if ``batch_first``).

        Args:
            query (Tensor): the tokens.
            identity (Tensor, optional): added to the output; ``query`` if None.
            query_pos (Tensor, optional): added to ``query`` before the projections.
            hw_shape (tuple[int, int], optional): the patch grid. If None, taken from the
                grid context set by the backbone/head hooks, else the non-prefix tokens must
                form a square.
            global_tokens (tuple[int, int], optional): ``(prefix, suffix)`` global tokens
                (:func:`mita_seg.ops.mita_attention`). If None, the grid context's (a
                Segmenter head's class tokens), else none.

        Returns:
            Tensor: ``identity + dropout(out)``, the shape of ``query``.
        """
        if (key is not None and key is not query) or (value is not None and value is not key):
            raise NotImplementedError('MiTAAttention is self-attention only (key and value '
                                      'must be None or the query)')
        if attn_mask is not None or key_padding_mask is not None:
            raise NotImplementedError('MiTAAttention does not support attn_mask or '
                                      'key_padding_mask')
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query = query.transpose(0, 1)
        B, N, C = query.shape
        q, k, v, (h, w), p = self.project(query, hw_shape)
        global_tokens = self.global_tokens_of(N, (h, w), global_tokens)
        # MiTA's experts' keys: the tokens that are not global
        setting = self.setting_on(N - sum(global_tokens), (h, w))
        x = attend(setting, q, k, v, (h, w), p, global_tokens)              # [B, H, N, d]
        x = x.transpose(1, 2).reshape(B, N, C)   # a view where [B, N, H, d] was written
        if self.dwc is not None:
            v_grid = v[:, :, p:p + h * w].transpose(1, 2).reshape(B, h, w, C).permute(0, 3, 1, 2)
            dwc = self.dwc(v_grid).flatten(2).transpose(1, 2)                  # [B, h*w, C]
            x = torch.cat([x[:, :p], x[:, p:p + h * w] + dwc, x[:, p + h * w:]], dim=1)
        x = self.attn.out_proj(x)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return identity + self.dropout_layer(self.proj_drop(x))


# What mmcv's MultiheadAttention takes in its **kwargs: torch's arguments, and its own
# deprecated 'dropout'
_TORCH_MHA_ARGS = frozenset(inspect.signature(nn.MultiheadAttention).parameters) - {
    'embed_dim', 'num_heads', 'batch_first'}

# (setting, setting as it ran) already logged by MiTASettingsMixin.setting_on
_ADAPTED: set = set()


def _log_once(message: str, *key) -> None:
    """Log ``message`` the first time ``key`` is seen."""
    if key not in _ADAPTED:
        _ADAPTED.add(key)
        print_log(message, logger='current')


def layer_indices(num_layers: int, layers: Optional[Iterable[int]],
                  name: str = 'layers') -> List[int]:
    """The sorted indices ``layers`` picks out of ``num_layers`` (negative ones count from
    the end; None for all).

    Raises:
        ValueError: an index out of range, naming the argument ``name``.
    """
    ids = list(range(num_layers)) if layers is None else list(layers)
    bad = [i for i in ids if not -num_layers <= i < num_layers]
    if bad:
        raise MiTASettingError(
            f'{name} {bad} out of range: there are {num_layers} encoder layers (indices '
            f'0..{num_layers - 1}, or -{num_layers}..-1 from the end)')
    return sorted({i % num_layers for i in ids})


# attention class -> the function that puts one of its modules on MiTA, keeping its
# parameters (MiTAAttention.from_mmcv here; the BEiT/MAE conversions are registered by
# their module, which depends on this one)
_TO_MITA: Dict[type, Callable[..., nn.Module]] = {MultiheadAttention: MiTAAttention.from_mmcv}


def register_mita_conversion(cls: type, convert: Callable[..., nn.Module]) -> None:
    """Make :func:`use_mita` put attention modules of exactly ``cls`` on MiTA with
    ``convert(module, **settings)``, which returns the MiTA module (a
    :class:`MiTASettingsMixin`) holding the very parameters of ``module``."""
    _TO_MITA[cls] = convert


def can_use_mita(attn: nn.Module) -> bool:
    """Whether :func:`use_mita` can put ``attn`` on MiTA (or reconfigure it)."""
    return isinstance(attn, MiTASettingsMixin) or type(attn) in _TO_MITA


def swapped_attention_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``model`` that runs a kind of
    :mod:`mita_seg.setting` (MiTA and the others: agent, block, top-k, window)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MiTASettingsMixin)]


def use_mita(owner: nn.Module, layer_ids: Iterable[int],
             setting: Optional[MiTASetting] = None, **settings) -> int:
    """Put the attention of ``owner.layers[i]`` (``i`` in ``layer_ids``) on MiTA (or
    another kind of :mod:`mita_seg.setting`), in place.

    ``owner`` is a token owner (a ViT or BEiT/MAE backbone, or a Segmenter mask head). An
    mmcv ``MultiheadAttention`` becomes a :class:`MiTAAttention` that takes over its very
    parameters (keys and weights unchanged), a BEiT/MAE attention its MiTA version
    (:mod:`mita_seg.models.beit_attention`). Either way the module gets the owner's grid
    (:func:`~mita_seg.models.grid.grid_context`). Other attention modules are left alone.

    Args:
        owner (nn.Module): the module with ``layers``.
        layer_ids (Iterable[int]): indices into ``owner.layers``.
        setting (MiTASetting, optional): the whole setting every layer takes (checked when
            it was made, not again).
        **settings: single keys instead (:data:`SETTING_KEYS`): a module swapped now takes
            them over the defaults, a module already swapped over its own settings; and
            ``with_dwc`` for modules swapped now, as a MiTA backbone's config may ask.

    Returns:
        int: the number of layers whose attention is now MiTA.
    """
    with_dwc = settings.pop('with_dwc', False)
    new = setting   # for the modules swapped now: made once, when one is
    done = 0
    for i in layer_ids:
        layer = owner.layers[i]
        if isinstance(layer.attn, MiTASettingsMixin):   # single keys over its own
            layer.attn.configure(setting, **settings)
        elif type(layer.attn) in _TO_MITA:
            old, old_cls = layer.attn, type(layer.attn)
            new = new or DEFAULT_SETTING.replace(**settings)
            layer.attn = _TO_MITA[old_cls](old, new, with_dwc=with_dwc)
            # kept outside the module tree (no state-dict keys) for use_dense
            layer.attn.__dict__[_DENSE_ORIGINAL] = (old, old_cls)
        else:
            continue
        layer.attn.grid = grid_context(owner)
        done += 1
    return done


# where a swapped module keeps the standard-attention module (and class) it replaced
_DENSE_ORIGINAL = '_mita_dense_original'


def use_dense(owner: nn.Module, layer_ids: Iterable[int]) -> int:
    """Put the attention of ``owner.layers[i]`` (``i`` in ``layer_ids``) back on the
    standard attention :func:`use_mita` replaced (the very module, with the very parameters:
    the reverse of the swap); layers on standard attention are left as they are. The module
    put back runs the dense path the model is on (its inner ``nn.MultiheadAttention`` is the
    one the MiTA module holds, which :func:`~mita_seg.models.set_dense_attn` switches too).

    Returns:
        int: the number of layers put back.

    Raises:
        ValueError: a MiTA module built as such, not by :func:`use_mita` (it has no
            standard attention to go back to; MiTA backbones and heads built from configs
            go through :func:`use_mita`, so their layers can).
    """
    done = 0
    for i in layer_ids:
        attn = owner.layers[i].attn
        if not isinstance(attn, MiTASettingsMixin):
            continue
        if _DENSE_ORIGINAL not in attn.__dict__:
            raise ValueError(
                f'layer {i} of {type(owner).__name__} was built on MiTA, not swapped: it has '
                'no standard attention to put back; start from a standard-attention model to '
                'make it dense')
        old, old_cls = attn.__dict__.pop(_DENSE_ORIGINAL)
        if old is attn:            # converted in place (BEiT/MAE): restore the class
            old.__class__ = old_cls
        old.train(attn.training)
        owner.layers[i].attn = old
        done += 1
    return done


def use_mita_layers(owner: nn.Module,
                    mita_cfg: Optional[dict] = None,
                    mita_layers: Optional[Iterable[int]] = None,
                    mita_layer_cfgs: Optional[List[Optional[dict]]] = None) -> int:
    """The MiTA layers of a MiTA backbone or head built from a config: ``mita_cfg`` on
    ``mita_layers`` (None: all), or per layer ``mita_layer_cfgs`` (one entry per layer of
    ``owner.layers``: settings over ``mita_cfg``, or None for standard attention; what an
    exported swap plan writes).

    Raises:
        ValueError: both ``mita_layers`` and ``mita_layer_cfgs``, or ``mita_layer_cfgs`` of
            another length than ``owner.layers``.
    """
    if mita_layer_cfgs is None:
        return use_mita(owner, layer_indices(len(owner.layers), mita_layers, 'mita_layers'),
                        **(mita_cfg or {}))
    if mita_layers is not None:
        raise ValueError('give mita_layers or mita_layer_cfgs, not both (mita_layer_cfgs: '
                         'None for a layer on standard attention)')
    if len(mita_layer_cfgs) != len(owner.layers):
        raise ValueError(f'mita_layer_cfgs has {len(mita_layer_cfgs)} entries; '
                         f'{type(owner).__name__} has {len(owner.layers)} layers')
    return sum(use_mita(owner, [i], **{**(mita_cfg or {}), **s})
               for i, s in enumerate(mita_layer_cfgs) if s is not None)
