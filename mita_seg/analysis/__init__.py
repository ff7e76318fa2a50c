"""Analysis of mita_seg models: FLOP counts that count attention and token selection.

- :mod:`.flop_handles`: jit handles for attention ops (SDPA, fused MHA, ``baddbmm``, MiTA)
  and tracing on the ``meta`` device (torch and mmengine only);
- :mod:`.flop_count`: :func:`~.flop_count.count_flops` of one forward, split into backbone /
  attention / neck / head;
- :mod:`.segmentor_cost`: segmentors built from configs, baseline and MiTA side by side,
  per crop and per image under the test mode;
- :mod:`.token_selection`: which tokens MiTA's routed experts select;
- :mod:`.attention_macs`: analytic attention multiply-adds of the calls a model makes (the
  sweep's ``attn_GMACs``).

Submodules are imported on use, so ``import mita_seg.analysis`` stays light.
"""
