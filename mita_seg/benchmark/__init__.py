"""Benchmarks of MiTA against softmax attention, one module per level of
``tools/benchmark.py`` (which parses its arguments, calls these and prints):

- :mod:`.op`: the operator (``--level op``): MiTA (the auto-selected backend: ``fused_cpu``
  on CPU, ``varlen`` on CUDA; and the plain PyTorch ``blocked`` one) against
  ``F.scaled_dot_product_attention`` (flash on CUDA) and against the path mmseg's ViT
  actually takes (mmcv ``MultiheadAttention`` -> ``nn.MultiheadAttention`` with
  ``need_weights=True``, which materialises the N x N weights), for forward and
  forward+backward; median times, the speed-up of MiTA over each alternative measured in
  the same run, the multiply-add ratio beside it, and peak memory. With a bias (``--bias``)
  BEiT's relative position bias instead (:class:`mita_seg.ops.RelPosBias`, a random table
  for the ``s x s`` grid): each MiTA backend that takes it on the device and SDPA with the
  dense ``[H, N, N]`` bias gathered from the table through a precomputed ``[N, N]`` index
  as mmseg's ``BEiTAttention`` does, each with and without the bias;
- :mod:`.threads`: SDPA and MiTA's forward on one thread and on more, all timed in turn;
- :mod:`.model`: images per second and peak memory of mmseg segmenters (``mmseg::``
  configs, random weights) four ways: ``mmseg`` as released, ``dense`` (the fast dense
  model a user would run instead: PyTorch's fused SDPA path and
  :class:`~mita_seg.models.SlimEncoderDecoder`'s lighter slide inference), ``MiTA`` (the
  fast dense model swapped) and ``bound`` (the same layers with their attention mixing
  removed, :mod:`mita_seg.analysis.bound`: what no attention there can beat), timed in
  turn; token merging (ToMe) and ``torch.compile`` columns on request;
- :mod:`.onnx`: ONNX Runtime on the CPU: a checkpoint exported unswapped, swapped to MiTA
  at each setting and with MiTA's node exported as ``out = v`` (the bound), timed in turn;
- :mod:`.onnx_op`: one attention layer in ONNX Runtime, softmax and MiTA exported alone;
- :mod:`.docs`: the README's speed table, generated from a committed ``--json`` record of
  the model level (``make bench-docs``);
- :mod:`.common`: what the levels share (the models by name, token counts, seeded inputs,
  the fused kernel's profile).

Peak memory on CPU is the rise of the process's peak RSS during one call
(``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs``), exact where glibc's
mmap threshold is lowered so that freed buffers go back to the OS (``tools/benchmark.py``
re-executes itself to set that); on CUDA it is the rise of ``torch.cuda.max_memory_allocated``.
Times are taken with glibc's thresholds where a running process has them
(:func:`mita_seg.analysis.timing.steady_allocator`). The timers, the memory peak and the
CPU's description are :mod:`mita_seg.analysis.timing`'s.

Each level has a function (or class) that measures and yields rows (dicts), and the
functions that write its header and rows as the tool prints them. The package sits above
:mod:`mita_seg.apis` (the ONNX levels export through it); its submodules are imported on use.
"""
