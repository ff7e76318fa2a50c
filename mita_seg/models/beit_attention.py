"""MiTA versions of mmseg's ``BEiTAttention`` and ``MAEAttention``: attention with BEiT's
dense relative-position bias, computed by the MiTA operator with the bias
(:class:`mita_seg.ops.bias.RelPosBias`), never as an ``N x N`` matrix.

A swapped module is the very module it was (ToMe-style: only its class changes), so its
parameters, buffers and state-dict keys (``qkv.weight``, ``q_bias``, ``v_bias``,
``relative_position_bias_table``, ``relative_position_index``, ``proj.*``) are those of the
checkpoint it was loaded from.
"""
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from mmseg.models.backbones.beit import BEiTAttention
from mmseg.models.backbones.mae import MAEAttention
from mmseg.registry import MODELS

from mita_seg.ops import RelPosBias, attend
from mita_seg.setting import BIAS_KINDS
from .attention import DEFAULT_SETTING, MiTASetting, MiTASettingsMixin, register_mita_conversion
from .grid import GridContext, GridMismatchError, grid_mismatch_message

__all__ = ['MiTABEiTAttention', 'MiTAMAEAttention']

# Arguments mmseg's TransformerEncoderLayer passes to every attention and BEiTAttention
# ignores (its own are attn_drop_rate / proj_drop_rate).
_MMCV_ARGS = ('attn_drop', 'proj_drop', 'batch_first')


@MODELS.register_module()
class MiTABEiTAttention(MiTASettingsMixin, BEiTAttention):
    """BEiT's attention with MiTA: mmseg's ``BEiTAttention`` (q/v bias, scale, relative
    position bias over cls + ``Wh x Ww`` grid tokens, output projection) whose softmax
    attention is :func:`mita_seg.ops.mita_attention` with the bias.

    The bias enters MiTA as the operator defines it (:mod:`mita_seg.ops.bias`): routed
    logits get the exact bias of each gathered key, landmark scores and shared logits the
    bias averaged over the landmark's region. Route-only MiTA
    (``with_shared_expert=False``) with ``topk >= N`` is exactly ``BEiTAttention``. A
    module whose ``relative_position_bias_table`` is None runs without bias (as mmseg's).

    The grid of each forward comes from the backbone's grid context
    (:func:`~mita_seg.models.grid.grid_context`, set by :func:`use_mita`); standalone, the
    tokens are taken to be cls + the ``window_size`` grid. With a bias table, the grid must
    be ``window_size``: another grid is a :class:`GridMismatchError` (a ``ValueError``).

    Args:
        embed_dims (int): number of input channels ``C``.
        num_heads (int): attention heads ``H``.
        window_size (tuple[int, int]): the patch grid ``(Wh, Ww)`` of the bias table.
        bias (str | bool): ``'qv_bias'`` (learnable q and v bias, zero k bias), True (a
            q/k/v bias) or False. Default: 'qv_bias'.
        qk_scale (float, optional): scale of ``q k^T`` instead of ``d ** -0.5``; folded
            into ``q`` (the router and landmarks then see the scaled ``q`` too).
            Default: None.
        attn_drop_rate (float): dropout on the attention weights: MiTA has no dense weight
            matrix, so it is accepted (with a warning) but not applied. Default: 0.
        proj_drop_rate (float): dropout after the output projection. Default: 0.
        init_cfg (dict, optional): initialization config. Default: None.
        **kwargs: MiTA settings (:data:`~mita_seg.models.attention.MITA_KEYS`: ``pool_size``,
            ``topk``, ``router_topk``, ``with_shared_expert``, ``shared_scale``), the
            defaults being :data:`~mita_seg.models.attention.MITA_DEFAULTS`; and the mmcv
            arguments (``attn_drop``, ``proj_drop``, ``batch_first``) mmseg's encoder layer
            passes, which ``BEiTAttention`` ignores too.
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 window_size: Tuple[int, int],
                 bias='qv_bias',
                 qk_scale: Optional[float] = None,
                 attn_drop_rate: float = 0.,
                 proj_drop_rate: float = 0.,
                 init_cfg: Optional[dict] = None,
                 **kwargs):
        mita_cfg = {k: v for k, v in kwargs.items() if k not in _MMCV_ARGS}
        setting = DEFAULT_SETTING.replace(**mita_cfg)  # checked before anything is built
        super().__init__(embed_dims, num_heads, window_size, bias=bias, qk_scale=qk_scale,
                         attn_drop_rate=attn_drop_rate, proj_drop_rate=proj_drop_rate,
                         init_cfg=init_cfg)
        self._init_mita(setting)

    # the kinds its relative position bias enters: MiTA (exact on the routed logits, the
    # region's mean on the landmarks'), top-k and window (each pair's own entry); agent and
    # block attention pool keys into summaries and take none
    supported_kinds = BIAS_KINDS

    def _init_mita(self, setting: MiTASetting) -> None:
        """The setting and no grid context yet."""
        self.configure(setting)
        self.grid: Optional[GridContext] = None
        if self.attn_drop.p > 0:
            warnings.warn(f'{type(self).__name__} does not apply attn_drop_rate='
                          f'{self.attn_drop.p} (no dense attention matrix); proj_drop_rate '
                          'and the layer\'s drop path still apply')

    @classmethod
    def from_beit(cls, attn: BEiTAttention, setting: MiTASetting,
                  with_dwc: bool = False) -> 'MiTABEiTAttention':
        """Put ``attn`` on MiTA in place: the same module, whose class becomes ``cls``, so
        its parameters, buffers and state-dict keys are untouched.

        Args:
            attn (BEiTAttention): mmseg's module (``MAEAttention`` for
                :class:`MiTAMAEAttention`).
            setting (MiTASetting): the MiTA setting (a MiTA one: other kinds do not take
                the relative position bias).
            with_dwc (bool): must be False (BEiT/MAE checkpoints have no DWC weights).

        Returns:
            MiTABEiTAttention: ``attn`` itself.
        """
        if with_dwc:
            raise ValueError('with_dwc=True is not available for BEiT/MAE attention (their '
                             'checkpoints have no DWC weights); leave with_dwc unset')
        if not issubclass(cls, type(attn)):
            raise TypeError(f'{cls.__name__}.from_beit cannot take a {type(attn).__name__}')
        old_cls = attn.__class__
        attn.__class__ = cls
        try:
            attn._init_mita(setting)
        except ValueError:
            attn.__class__ = old_cls  # a kind it cannot run: left as it was
            raise
        return attn

    def grid_shape(self, num_tokens: int) -> Tuple[int, int]:
        """The patch grid ``(h, w)`` of a forward over ``num_tokens`` tokens (cls first):
        the grid context's, else ``window_size``.

        Raises:
            GridMismatchError: the grid is not the bias table's ``window_size``, or the
                tokens are not cls + ``h x w``.
        """
        window = (int(self.window_size[0]), int(self.window_size[1]))
        hw = self.grid.hw_shape if self.grid is not None else None
        h, w = window if hw is None else hw
        if self.relative_position_bias_table is not None and (h, w) != window:
            raise GridMismatchError(grid_mismatch_message(
                f'{type(self).__name__}: its relative position bias table', window, (h, w)))
        if num_tokens != 1 + h * w:
            raise GridMismatchError(
                f'{type(self).__name__}: {num_tokens} tokens are not a cls token followed by '
                f'the {h}x{w} patch grid ({1 + h * w} tokens)')
        return h, w

    def rel_pos_bias(self) -> Optional[RelPosBias]:
        """The bias as the operator takes it (the table ``[H, T]`` and its window), or None
        without a table."""
        table = self.relative_position_bias_table                  # [T, H]
        if table is None:
            return None
        return RelPosBias(table.t(), (int(self.window_size[0]), int(self.window_size[1])))

    def project(self, x: torch.Tensor):
        """Heads and grid of ``x`` (``[B, N, C]``), as ``BEiTAttention.forward`` projects.

        Returns:
            tuple: ``q, k, v`` (``[B, H, N, d]``; ``q`` carries a custom ``qk_scale`` as
            ``scale * sqrt(d)``), the grid ``(h, w)`` and the number of prefix tokens (1).
        """
        B, N, C = x.shape
        h, w = self.grid_shape(N)
        if self.bias == 'qv_bias':                        # as BEiTAttention: zero k bias
            k_bias = torch.zeros_like(self.v_bias, requires_grad=False)
            qkv_bias = torch.cat((self.q_bias, k_bias, self.v_bias))
            qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        else:
            qkv = self.qkv(x)
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        d = q.shape[-1]                                   # q, k, v: [B, H, N, d]
        if self.scale != d**-0.5:                         # MiTA scales q k^T by d ** -0.5
            q = q * (self.scale * d**0.5)
        return q, k, v, (h, w), 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Self-attention over ``x`` (``[B, N, C]``: cls, then the ``h x w`` grid row-major).

        Returns:
            Tensor: ``[B, N, C]``, after the output projection (the layer adds the
            residual).
        """
        B, N, C = x.shape
        q, k, v, (h, w), p = self.project(x)
        x = attend(self.setting_on(N, (h, w)), q, k, v, (h, w), p,
                   rel_pos_bias=self.rel_pos_bias())                        # [B, H, N, d]
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


@MODELS.register_module()
class MiTAMAEAttention(MiTABEiTAttention, MAEAttention):
    """MAE's attention with MiTA: :class:`MiTABEiTAttention` with ``MAEAttention``'s
    initialisation (the bias table stays zero). Same arguments."""


# what use_mita / swap_attention turn mmseg's modules into
register_mita_conversion(BEiTAttention, MiTABEiTAttention.from_beit)
register_mita_conversion(MAEAttention, MiTAMAEAttention.from_beit)
