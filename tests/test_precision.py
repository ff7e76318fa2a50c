"""Mixed precision: the operator in bfloat16/float16 against the float32 reference, and
``tools/train.py --amp`` on CPU.

The tolerance is FlashAttention's: the low-precision result may be off the float32
reference by at most twice as much as standard attention (PyTorch SDPA) computed in the same
low precision is off its own float32 result, for outputs and for the gradients of q, k, v.
Both are fed the very same (rounded) inputs, so the test measures arithmetic, not rounding
of the inputs; the routing decisions then agree as well. MiTA and softmax attention are
different functions whose outputs and gradients differ in magnitude (the shared expert adds
a path), so errors are compared relative to the float32 result's largest magnitude; in the
route-only ``topk >= N`` case they are the same function and the absolute errors are held to
the same bound as well. The fused CPU kernel is held to it with its bf16/fp16 read-out GEMMs
as chosen for the CPU, forced on (oneDNN's brgemm, or cpublas's plain GEMM where that does
not run) and forced off (``MITA_CPU_BF16_GEMM``).
"""
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mita_seg.ops import Inputs, mita_attention, mita_attention_reference
from mita_seg.ops.fused_cpu import _C

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))

# name: (B, H, h, w, prefix, suffix, d, pool, topk, shared)
CASES = {
    'vit-cls-16x12-shared': (2, 3, 16, 12, 1, 0, 32, 4, 24, True),
    'suffix-9x13-shared': (1, 2, 9, 13, 0, 10, 16, (3, 5), 20, True),
    'vit-cls-10x10-route-only': (2, 2, 10, 10, 1, 0, 32, 3, 30, False),
    # route-only with topk >= N is exactly softmax attention
    'route-only-topk-N': (2, 2, 8, 8, 1, 0, 32, 2, 65, False),
}


def _lowp_supported(dtype, device):
    if device == 'cuda' and not torch.cuda.is_available():
        return 'no CUDA device'
    try:
        x = torch.randn(1, 1, 4, 8, device=device).to(dtype)
        F.scaled_dot_product_attention(x, x, x)
        (x @ x.transpose(-1, -2)).sum()
    except RuntimeError as e:  # pragma: no cover - depends on the torch build
        return str(e)
    return None


def _max_err(a, ref):
    """Largest absolute error of ``a``, and the same relative to ``ref``'s magnitude."""
    err = (a.float() - ref.float()).abs().max().item()
    return err, err / ref.abs().max().item()


def _check(what, mita, mita_ref, sdpa, sdpa_ref, same_function):
    (err, rel), (base, base_rel) = _max_err(mita, mita_ref), _max_err(sdpa, sdpa_ref)
    assert rel <= 2 * base_rel, (f'{what}: MiTA relative error {rel:.3g} > 2 x SDPA relative '
                                 f'error {base_rel:.3g}')
    if same_function:
        assert err <= 2 * base, f'{what}: MiTA error {err:.3g} > 2 x SDPA error {base:.3g}'


# blocked: on CUDA its gathers and P @ V run in the input dtype, its logits in float32
@pytest.mark.parametrize('backend', [None, 'varlen', 'blocked'],
                         ids=['auto', 'varlen', 'blocked'])
@pytest.mark.parametrize('device', ['cpu', 'cuda'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_low_precision_within_flash_tolerance(case, dtype, device, backend):
    why = _lowp_supported(dtype, device)
    if why:
        pytest.skip(f'{dtype} attention not supported on {device} here: {why}')
    _check_low_precision(case, dtype, device, backend)


@pytest.mark.parametrize('setting', ['1', '0'], ids=['lowp-gemms', 'float32-gemms'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_fused_cpu_gemm_settings_within_flash_tolerance(case, dtype, setting, monkeypatch):
    """The fused CPU kernel with its bf16/fp16 read-out GEMMs forced on (oneDNN's brgemm, or
    cpublas's plain GEMM where that does not run on this CPU) and off."""
    if _C is None:
        pytest.skip('the C++ extension mita_seg._C is not built')
    monkeypatch.setenv('MITA_CPU_BF16_GEMM', setting)
    expected = (('float32', ) if setting == '0' else
                ('brgemm-packed', 'brgemm-vnni', 'brgemm-rows', 'cpublas'))
    assert _C.lowp_gemm_path(dtype) in expected
    _check_low_precision(case, dtype, 'cpu', 'fused_cpu')


def _check_low_precision(case, dtype, device, backend):
    B, H, h, w, p, s, d, pool, topk, shared = case
    N = p + h * w + s
    g = torch.Generator().manual_seed(0)
    lowp = [torch.randn(B, H, N, d, generator=g).to(device, dtype).requires_grad_()
            for _ in range(3)]
    fp32 = [t.detach().float().requires_grad_() for t in lowp]
    dout = torch.randn(B, H, N, d, generator=g).to(device, dtype)
    kw = dict(hw_shape=(h, w), pool_size=pool, topk=min(topk, N), num_prefix_tokens=p,
              with_shared_expert=shared)

    ref = mita_attention_reference(Inputs(*fp32, **{**kw, 'pool_size': (pool, pool) if
                                                    isinstance(pool, int) else pool}))
    out = mita_attention(*lowp, **kw, backend=backend)
    assert out.dtype == dtype and torch.isfinite(out).all()
    sdpa_ref = F.scaled_dot_product_attention(*fp32)
    sdpa = F.scaled_dot_product_attention(*lowp)

    same = not shared and topk >= N  # route-only MiTA with every key is softmax attention
    _check(f'{dtype} output', out, ref, sdpa, sdpa_ref, same)

    grads = torch.autograd.grad(out, lowp, dout)
    grads_ref = torch.autograd.grad(ref, fp32, dout.float())
    grads_sdpa = torch.autograd.grad(sdpa, lowp, dout)
    grads_sdpa_ref = torch.autograd.grad(sdpa_ref, fp32, dout.float())
    for name, a, r, b, br in zip('qkv', grads, grads_ref, grads_sdpa, grads_sdpa_ref):
        assert a.dtype == dtype and torch.isfinite(a).all()
        assert r.abs().max() > 0, f'd{name} of the reference is zero: the case tests nothing'
        _check(f'{dtype} d{name}', a, r, b, br, same)


def test_route_only_topk_n_is_attention_in_bf16():
    # the same maths as SDPA, so in bf16 it must agree with SDPA's fp32 result as well
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 1 + 36, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    out = mita_attention(q, k, v, hw_shape=(6, 6), pool_size=2, topk=37,
                         with_shared_expert=False)
    full = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), full, atol=2e-2, rtol=2e-2)


def test_operator_under_cpu_autocast():
    """Inside ``torch.autocast('cpu', bfloat16)`` (what ``--amp`` runs) the op takes the
    bf16 q, k, v of an autocast linear and stays as accurate as outside autocast."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1 + 64, 32, generator=g)
    proj = torch.nn.Linear(32, 3 * 32)
    kw = dict(hw_shape=(8, 8), pool_size=2, topk=16)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        q, k, v = proj(x).reshape(2, 65, 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
        assert q.dtype == torch.bfloat16
        out = mita_attention(q, k, v, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    outside = mita_attention(q, k, v, **kw)  # same bf16 inputs, no autocast
    torch.testing.assert_close(out, outside, atol=0, rtol=0)


def test_train_amp_on_cpu(tools, tmp_path):
    """``tools/train.py --amp`` trains the tiny MiTA UperNet in bfloat16 autocast on CPU."""
    pytest.importorskip('mmseg')
    if torch.cuda.is_available():
        pytest.skip('checks the CPU (bfloat16) path; CUDA runs use AmpOptimWrapper (fp16)')
    env = dict(os.environ, OMP_NUM_THREADS='2')
    data = tmp_path / 'data'
    subprocess.run([sys.executable, osp.join(ROOT, 'tools/dataset/make_tiny_ade20k.py'),
                    '--out', str(data), '--train', '4', '--val', '1', '--size', '64'],
                   check=True, env=env, capture_output=True)
    config = tools.tiny_train_config(tmp_path / 'amp.py', data, iters=3)
    work = tmp_path / 'work'
    res = subprocess.run([sys.executable, osp.join(ROOT, 'tools/train.py'), str(config),
                          '--work-dir', str(work), '--amp'], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert 'BF16AmpOptimWrapper' in (work / 'amp.py').read_text()  # the dumped config
    log = res.stdout + res.stderr
    losses = [float(x) for x in re.findall(r'Iter\(train\) \[\s*\d+/3\].*? loss: ([-\w.]+)', log)]
    assert len(losses) == 3, log[-3000:]
    assert all(torch.isfinite(torch.tensor(losses))), losses
