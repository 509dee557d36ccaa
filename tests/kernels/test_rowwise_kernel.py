"""The models' one-launch kernels (:mod:`loopq.kernels.rowwise_kernel`: RMSNorm, the CTA transition adapter, RoPE)
against the torch ops they replace, computed on the CPU (the oracle: the upstream models' rule, IEEE ``sqrt`` and
divisions on a CPU).

RMSNorm: on rows of integers times a power of two every partial sum of squares is exact in any order, so the kernel,
which sums in another order, must give **the same bits**: the mean, ``1 / sqrt``, the rounding to the input's dtype
and the weight's product (rounded to the input's dtype, or promoted to fp32) are the same IEEE operations. On random
rows only the sum's order differs: ``1 / rms`` within the sum's rounding bound, hence outputs within it plus one unit
of the input's dtype (the rounding before the weight), and for 16-bit inputs nearly all equal. The adapter: the same
on dyadic values (every product and sum exact), within the fp32 bound of its two products on random ones. RoPE is
elementwise: the same bits on random values. fp32 and fp16 here; bf16 on a GPU only (the interpreter truncates
fp32 -> bf16).
"""

from __future__ import annotations

import pytest
import torch

from loopq.kernels import rowwise_kernel
from loopq.models import base
from tests.kernels.cases import ON_CUDA, cuda_only

DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=cuda_only)]
#: (K, weight dtype or None or "same", eps): a row shorter than a chunk, Ouro's width, and one wider than a program's
#: block (two blocks of 4096, the sum over six chunks of 1024)
CASES = [(80, "same", 1e-6), (80, None, None), (2048, "same", 1e-6), (2048, torch.float32, 1e-5), (5632, "same", None)]


def reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    """``rms_norm``'s torch ops on the CPU."""
    return base.rms_norm_ops(x.cpu(), None if weight is None else weight.cpu(), eps)


def integer_rows(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Integers in [-40, 40] times a power of two per row: sums of squares exact in any order (< 2^24)."""
    x = torch.randint(-40, 41, shape, generator=gen).float()
    return x * 2.0 ** torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float()


def weight_for(k: int, kind: object, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor | None:
    if kind is None:
        return None
    return (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype if kind == "same" else kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "kind", "eps"), CASES)
def test_bit_for_bit_where_the_sum_is_exact(device, dtype, k, kind, eps):
    gen = torch.Generator().manual_seed(k)
    x = integer_rows((2, 3, k), gen).to(dtype)
    weight = weight_for(k, kind, dtype, gen)
    got = rowwise_kernel.rms_norm(x.to(device), None if weight is None else weight.to(device), eps)
    want = reference(x, weight, eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "kind", "eps"), CASES[:4])
def test_random_rows_within_the_sums_rounding(device, dtype, k, kind, eps):
    """Each side's sum of K positive squares is within gamma_K of the exact one, then mean, + eps, sqrt and the
    division add 3 roundings: the two ``1 / rms`` differ by at most gamma_K + 6u relative, and the rounding to the
    input's dtype (before the weight) by one unit of that dtype on each side."""
    gen = torch.Generator().manual_seed(k + 1)
    x = (3 * torch.randn(16, k, generator=gen)).to(dtype)
    weight = weight_for(k, kind, dtype, gen)
    got = rowwise_kernel.rms_norm(x.to(device), None if weight is None else weight.to(device), eps).cpu()
    want = reference(x, weight, eps)
    u = 2.0**-24
    rel = k * u / (1 - k * u) + 6 * u + 2 * torch.finfo(dtype).eps
    assert bool(((got.double() - want.double()).abs() <= rel * want.double().abs()).all())
    if dtype != torch.float32:  # r's last bits are far below a 16-bit unit: only values next to a boundary move
        assert (got == want).float().mean() >= 0.99  # measured >= 0.9998


def test_a_permuted_non_contiguous_input_and_no_rows(device):
    gen = torch.Generator().manual_seed(3)
    x = integer_rows((4, 64), gen).T.contiguous().T  # [4, 64] with strides (1, 4)
    assert not x.is_contiguous()
    assert torch.equal(rowwise_kernel.rms_norm(x.to(device), None, 1e-6).cpu(), reference(x, None, 1e-6))
    assert rowwise_kernel.rms_norm(torch.empty(0, 64, device=device), None, None).shape == (0, 64)


def test_a_weight_of_another_width_is_refused(device):
    with pytest.raises(ValueError, match="weight of 32 features for rows of 64"):
        rowwise_kernel.rms_norm(torch.ones(2, 64, device=device), torch.ones(32, device=device), None)


@pytest.fixture
def on_this_device(monkeypatch, device):
    """The kernel's devices include the test's (the CPU under the interpreter)."""
    monkeypatch.setattr(rowwise_kernel, "DEVICES", {device.type})


def test_applies_only_where_no_gradient_is_recorded(on_this_device, device):
    x = torch.randn(3, 64, device=device)
    w = torch.ones(64, device=device)
    assert rowwise_kernel.applies(x, w) and rowwise_kernel.applies(x, None)
    assert not rowwise_kernel.applies(x.requires_grad_(True), w)
    assert not rowwise_kernel.applies(x.detach(), w.requires_grad_(True))
    with torch.no_grad():
        assert rowwise_kernel.applies(x, w)  # a frozen forward: nothing to record
    w = w.detach()
    assert not rowwise_kernel.applies(x.detach().double(), None)  # float64 keeps the torch ops
    assert not rowwise_kernel.applies(x.detach(), w.double())
    assert not rowwise_kernel.applies(torch.randn(1, rowwise_kernel.MAX_K + 1, device=device), None)
    assert not rowwise_kernel.applies(torch.randn(0, 64, device=device), None)


def test_what_torch_would_broadcast_or_refuse_keeps_the_torch_ops(on_this_device, device):
    """Found by review: each of these passed the predicates and read past a tensor (or crashed them)."""
    x = torch.randn(3, 8, device=device)
    assert not rowwise_kernel.applies(x, torch.arange(16.0, device=device)[::2])  # a strided weight
    assert not rowwise_kernel.applies(x, torch.full((1,), 2.0, device=device).expand(8))  # stride 0
    assert not rowwise_kernel.applies(x, torch.ones(1, device=device))  # broadcast over the features
    assert not rowwise_kernel.applies(x[..., :1], torch.ones(8, device=device))
    assert not rowwise_kernel.applies(torch.tensor(2.0, device=device), None)  # 0-dim
    q = torch.randn(1, 2, 3, 8, device=device)
    table = torch.randn(3, 8, device=device)
    assert not rowwise_kernel.rope_applies(q, table[:, :1], table[:, :1])  # a table of one column
    assert not rowwise_kernel.rope_applies(q, torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))
    assert not rowwise_kernel.rope_applies(q, table, table.clone().requires_grad_(True))  # sin records a gradient
    h, a, b, eta = torch.randn(2, 8, device=device), torch.ones(8, device=device), torch.zeros(8, device=device), None
    u = v = torch.randn(8, 4, device=device)
    eta = torch.ones(4, device=device)
    assert rowwise_kernel.transition_applies(h, (a, b, eta, u, v))
    assert not rowwise_kernel.transition_applies(h.reshape(4, 4), (a, b, eta, u, v))  # another width
    assert not rowwise_kernel.transition_applies(h, (a[:4], b, eta, u, v))
    assert not rowwise_kernel.transition_applies(h, (a, b, eta[:2], u, v))
    wide = torch.randn(8, rowwise_kernel.MAX_RANK + 1, device=device)
    assert not rowwise_kernel.transition_applies(h, (a, b, torch.ones(wide.shape[1], device=device), wide, wide))


def test_kernels_launch_on_their_tensors_gpu(monkeypatch):
    """Triton launches on the current CUDA device; a tensor on another (``--device cuda:1``) needs that device
    made current around the launch (``packing.launch_device``), and nothing is done otherwise."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from loopq.kernels import packing

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    other = packing.launch_device(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1)))
    assert isinstance(other, torch.cuda.device) and other.idx == 1
    for device in (torch.device("cuda", 0), torch.device("cuda")):
        assert isinstance(packing.launch_device(SimpleNamespace(is_cuda=True, device=device)), nullcontext)
    assert isinstance(packing.launch_device(torch.ones(1)), nullcontext)


def test_off_the_kernels_devices_nothing_changes():
    assert "cpu" not in rowwise_kernel.DEVICES
    assert not rowwise_kernel.applies(torch.randn(3, 64), None)


def test_rms_norm_takes_the_kernel_without_autograd_and_the_torch_ops_with_it(on_this_device, device, monkeypatch):
    calls = []
    kernel = rowwise_kernel.rms_norm
    monkeypatch.setattr(rowwise_kernel, "rms_norm", lambda *a, **k: calls.append(a) or kernel(*a, **k))
    gen = torch.Generator().manual_seed(5)
    x = integer_rows((2, 64), gen).to(device)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(device).requires_grad_(True)
    with torch.no_grad():
        fused = base.rms_norm(x, w, 1e-6)
    assert len(calls) == 1 and torch.equal(fused.cpu(), reference(x, w.detach(), 1e-6))
    traced = base.rms_norm(x, w, 1e-6)
    assert len(calls) == 1 and traced.grad_fn is not None  # the student's norms keep autograd's backward
    assert torch.equal(traced.detach().cpu(), fused.cpu())


@pytest.mark.parametrize("teacher", ["tiny-ouro", "tiny-loopformer", "tiny-parcae"])
def test_every_architecture_gives_the_same_tokens_with_the_kernel(on_this_device, device, monkeypatch, teacher):
    """The three models' norms (Ouro's four per layer, LoopFormer's unweighted modulated ones, Parcae's) through
    the kernel: logits within the last bits of the torch ops', the same greedy tokens."""
    from loopq.models import load_looplm
    from loopq.paths import REPO_ROOT

    model = load_looplm(REPO_ROOT / "loopq" / "assets" / teacher, dtype=torch.float32).to(device).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    calls = []
    kernel = rowwise_kernel.rms_norm
    monkeypatch.setattr(rowwise_kernel, "rms_norm", lambda *a, **k: calls.append(a) or kernel(*a, **k))
    with torch.inference_mode():
        fused = model(ids).logits
        monkeypatch.setattr(rowwise_kernel, "DEVICES", set())
        plain = model(ids).logits
    assert calls, "no norm took the kernel"
    assert torch.allclose(fused, plain, rtol=1e-4, atol=1e-4), float((fused - plain).abs().max())
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA default: compiled kernels only")
def test_on_cuda_the_models_norms_take_the_kernel():
    assert rowwise_kernel.applies(torch.randn(2, 64, device="cuda", dtype=torch.bfloat16), None)


def power_rows(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Rows of +-1 (5/8) and +-3 (3/8) times a power of two: mean square 4^(e + 1), so with ``eps = 0`` the
    RMSNorm's ``1 / rms`` is a power of two in every implementation (``shape[-1]`` a multiple of 8)."""
    k = shape[-1]
    base = torch.cat([torch.ones(5 * k // 8), 3 * torch.ones(3 * k // 8)])
    n = int(torch.tensor(shape[:-1]).prod())
    rows = torch.stack([base[torch.randperm(k, generator=gen)] for _ in range(n)])
    rows = rows * torch.where(torch.rand(n, k, generator=gen) < 0.5, -1.0, 1.0)
    return (rows * 2.0 ** torch.randint(-2, 3, (n, 1), generator=gen).float()).reshape(shape)


def dyadic(shape: tuple[int, ...], denominator: int, top: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-top, top + 1, shape, generator=gen).float() / denominator


def adapter_params(d: int, rank: int, gen: torch.Generator, exact: bool) -> tuple[torch.Tensor, ...]:
    """(a, b, eta, U, V): dyadic with few bits (every product and partial sum exact in fp32) or random."""
    if exact:
        return (dyadic((d,), 8, 16, gen), dyadic((d,), 8, 16, gen), dyadic((rank,), 4, 8, gen),
                dyadic((d, rank), 16, 16, gen), dyadic((d, rank), 16, 16, gen))  # fmt: skip
    return (1 + 0.1 * torch.randn(d, generator=gen), 0.1 * torch.randn(d, generator=gen),
            torch.randn(rank, generator=gen), torch.randn(d, rank, generator=gen) / d**0.5,
            torch.randn(d, rank, generator=gen) / d**0.5)  # fmt: skip


def adapter_reference(h: torch.Tensor, params: tuple[torch.Tensor, ...], eps: float) -> torch.Tensor:
    """``TransitionAdapters.forward``'s torch ops on the CPU: fp32 compute, cast back to ``h``'s dtype."""
    from loopq.quant.cta import transition_adapter

    devices, rowwise_kernel.DEVICES = rowwise_kernel.DEVICES, set()
    try:
        return transition_adapter(h.cpu().float(), *params, eps).to(h.dtype)
    finally:
        rowwise_kernel.DEVICES = devices


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "rank"), [(64, 8), (2048, 8), (200, 3)])
def test_transition_bit_for_bit_where_every_sum_is_exact(device, dtype, d, rank):
    gen = torch.Generator().manual_seed(d + rank)
    h = power_rows((2, 3, d), gen).to(dtype)
    params = adapter_params(d, rank, gen, exact=True)
    got = rowwise_kernel.transition(h.to(device), *(p.to(device) for p in params), 0.0)
    want = adapter_reference(h, params, 0.0)
    assert got.dtype == dtype and got.shape == h.shape
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "rank"), [(64, 8), (2048, 8)])
def test_transition_of_random_rows_within_the_fp32_bound(device, dtype, d, rank):
    """Each side computes every output as at most ``d + rank + 10`` fp32 roundings of the terms of
    ``h + (a - 1) n + b + ((n V) eta) U^T`` (n's own ``1 / rms`` included), so each is within gamma of that count
    times the sum of the terms' magnitudes of the exact value, the two within twice that, plus one unit of ``h``'s
    dtype for the rounding of the output."""
    gen = torch.Generator().manual_seed(d)
    h = (2 * torch.randn(4, d, generator=gen)).to(dtype)
    params = adapter_params(d, rank, gen, exact=False)
    a, b, eta, u, v = (p.double() for p in params)
    got = rowwise_kernel.transition(h.to(device), *(p.to(device) for p in params), 1e-6).cpu()
    want = adapter_reference(h, params, 1e-6)
    h64 = h.double()
    n = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6)
    terms = h64.abs() + (a - 1).abs() * n.abs() + b.abs() + ((n.abs() @ v.abs()) * eta.abs()) @ u.abs().T
    count = d + rank + 10
    gamma = count * 2.0**-24 / (1 - count * 2.0**-24)
    bound = 2 * gamma * terms + torch.finfo(dtype).eps * want.double().abs()
    assert bool(((got.double() - want.double()).abs() <= bound).all())


def test_the_adapters_take_the_kernel_only_without_autograd(on_this_device, device, monkeypatch):
    from loopq.quant.cta import TransitionAdapters

    calls = []
    kernel = rowwise_kernel.transition
    monkeypatch.setattr(rowwise_kernel, "transition", lambda *a: calls.append(a) or kernel(*a))
    adapters = TransitionAdapters(64, num_loops=4, rank=8).to(device)
    with torch.no_grad():
        adapters.eta.normal_()  # away from the identity it starts as
    h = torch.randn(2, 5, 64, device=device, dtype=torch.float16)
    with torch.no_grad():
        fused = adapters(h, 1)
    assert len(calls) == 1 and fused.dtype == torch.float16
    traced = adapters(h, 1)  # the parameters train: autograd's ops
    assert len(calls) == 1 and traced.grad_fn is not None
    assert torch.allclose(fused.float(), traced.detach().float(), rtol=2e-3, atol=2e-3)  # fp16 outputs
    with torch.no_grad():
        assert not rowwise_kernel.transition_applies(h, (adapters.a[0].double(),))


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from loopq.models.ouro import apply_rope

    devices, rowwise_kernel.DEVICES = rowwise_kernel.DEVICES, set()
    try:
        return apply_rope(x.cpu(), cos.cpu(), sin.cpu())
    finally:
        rowwise_kernel.DEVICES = devices


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decode", [False, True])
def test_rope_is_the_torch_ops_bit_for_bit(device, dtype, decode):
    """Elementwise with the same roundings (each product and the sum rounded to the input's dtype): the same bits,
    on random values. Queries and grouped keys as the model makes them (transposed views of the projection), tables
    of a full forward ``[S, dh]`` and of a cached step ``[B, 1, S, dh]`` (per-row positions)."""
    from loopq.models.ouro import rope_tables

    gen = torch.Generator().manual_seed(int(decode))
    b, s, heads, kv_heads, dh = 2, 5, 4, 2, 16
    qkv = torch.randn(b, s, (heads + kv_heads) * dh, generator=gen).to(dtype)
    q = qkv[..., : heads * dh].view(b, s, heads, dh).transpose(1, 2)  # non-contiguous, as in OuroAttention
    k = qkv[..., heads * dh :].view(b, s, kv_heads, dh).transpose(1, 2)
    positions = torch.randint(0, 4000, (b, s) if decode else (s,), generator=gen)
    cos, sin = rope_tables(dh, 10000.0, positions, dtype)
    if decode:
        cos, sin = cos[:, None], sin[:, None]
    for x in (q, k):
        assert rowwise_kernel.rope_applies(x.to(device), cos.to(device), sin.to(device)) == (device.type == "cuda")
        got = rowwise_kernel.rope(x.to(device), cos.to(device), sin.to(device))
        assert got.is_contiguous() and torch.equal(got.cpu(), rope_reference(x, cos, sin))


def test_rope_applies_only_where_it_can(on_this_device, device):
    x = torch.randn(1, 2, 3, 8, device=device)
    cos, sin = torch.randn(3, 8, device=device), torch.randn(3, 8, device=device)
    assert rowwise_kernel.rope_applies(x, cos, sin)
    assert not rowwise_kernel.rope_applies(x.requires_grad_(True), cos, sin)  # the student's queries
    x = x.detach()
    assert not rowwise_kernel.rope_applies(x, cos.half(), sin.half())  # torch would promote
    assert not rowwise_kernel.rope_applies(x, torch.randn(2, 3, 8, device=device)[:1].expand(4, 3, 8)[None], sin)
    assert not rowwise_kernel.rope_applies(x, torch.randn(4, 8, device=device), torch.randn(4, 8, device=device))
    assert not rowwise_kernel.rope_applies(x.transpose(-1, -2).contiguous().transpose(-1, -2), cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["same", torch.float32])
def test_a_residual_plus_the_norm_in_one_launch_is_torchs_two_ops(device, dtype, kind):
    """``h + rms_norm(x)`` (Ouro's sandwich norms): the norm rounded to its dtype, then the sum rounded: the same
    bits as the torch ops on integer rows (the norm exact as above), with any residual."""
    gen = torch.Generator().manual_seed(11)
    x = integer_rows((3, 2, 80), gen).to(dtype)
    weight = weight_for(80, kind, dtype, gen)
    h = torch.randn(3, 2, 80, generator=gen).to(out_dtype := torch.promote_types(dtype, weight.dtype))
    got = rowwise_kernel.rms_norm(x.to(device), weight.to(device), 1e-6, residual=h.to(device))
    assert got.dtype == out_dtype and torch.equal(got.cpu(), h + reference(x, weight, 1e-6))
    with pytest.raises(ValueError, match="a residual"):
        rowwise_kernel.rms_norm(x.to(device), weight.to(device), 1e-6, residual=h[:, :1].to(device))


def test_add_norm_takes_one_launch_only_where_torch_would_not_promote_or_record(on_this_device, device, monkeypatch):
    calls = []
    kernel = rowwise_kernel.rms_norm
    monkeypatch.setattr(rowwise_kernel, "rms_norm", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    gen = torch.Generator().manual_seed(12)
    norm = base.RMSNorm(64, 1e-6).to(device)
    x, h = integer_rows((2, 64), gen).to(device), torch.randn(2, 64, generator=gen).to(device)
    with torch.no_grad():
        fused = base.add_norm(h, norm, x)
        assert len(calls) == 1 and "residual" in calls[0]
        assert torch.equal(fused.cpu(), h.cpu() + reference(x, norm.weight, 1e-6))
        base.add_norm(h.half(), norm, x)  # fp32 norm, fp16 residual: torch promotes, the kernel would not
        handle = norm.register_forward_hook(lambda *a: None)
        base.add_norm(h, norm, x)  # a hooked module is called as such
        handle.remove()
    assert len(calls) == 3 and "residual" not in calls[1] | calls[2]  # the norms inside those two calls, alone
    traced = base.add_norm(h, norm, x)  # the norm's weight trains
    assert len(calls) == 3 and traced.grad_fn is not None
