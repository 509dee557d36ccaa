"""The RMSNorm folded into the quantizer (``quantized_linear(..., norm_weight=, norm_eps=)``, issue 43's launches).

Oracle: the same call on ``rms_norm(x, weight, eps)`` (:func:`loopq.models.base.rms_norm`, what the model computed
before the fold) without the norm. The kernel sums a token's squares in another order than torch, so ``1 / rms`` may
differ in its last bits; on rows of integers (times a power of two) every partial sum is exact in any order, the mean
and ``1 / sqrt`` are the same IEEE operations on both sides, so there the fold must be **bit for bit** the unfolded
call: codes, scales and GEMM output, in both quantizer paths (exact and tensor-core), at decode (M <= 16) and prefill
sizes, for fp32 and fp16 inputs (bf16 on a GPU only: the interpreter truncates fp32 -> bf16 instead of
rounding), with the weight in the input's dtype (the product rounded to it, as torch rounds ``y * weight``) and in
fp32 (promoted). On random real rows the codes may then differ only where a value lies within
those last bits of a rounding tie: measured 0 of 5,120 codes here; at most 1 % allowed, scales within 1e-6 relative.

On a GPU (``device`` is cuda when the compiled kernels run, ``scripts/gpu_check.sh``) torch's ``rsqrt`` is CUDA's
``rsqrtf`` (not correctly rounded, <= 2 ulp), so the unfolded reference itself may differ in ``1 / rms``: there the
exact comparison takes rows whose mean square is a power of 4 with ``eps = 0`` (``1 / rms`` a power of two, exact in
every implementation), and the other cases are held to the random-row tolerance.
"""

from __future__ import annotations

import pytest
import torch

from loopq.kernels import ops, quantize_kernel
from loopq.kernels.packing import quantize_weight, tile_weight
from loopq.models.base import rms_norm_ops as rms_norm  # the torch ops, on a GPU too
from tests.kernels.cases import cuda_only, random_transform


def integer_rows(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Integers in [-40, 40] times a power of two per row: sums of squares exact in any order (< 2^24)."""
    x = torch.randint(-40, 41, (m, k), generator=gen).float()
    return x * 2.0 ** torch.randint(-3, 4, (m, 1), generator=gen).float()


def power_rows(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of +-1 (5/8 of them) and +-3 (3/8), shuffled, times a power of two: mean square 4^(e + 1), so
    ``1 / rms`` is a power of two with ``eps = 0`` (``k`` a multiple of 8)."""
    base = torch.cat([torch.ones(5 * k // 8), 3 * torch.ones(3 * k // 8)])
    rows = torch.stack([base[torch.randperm(k, generator=gen)] for _ in range(m)])
    signs = torch.randint(0, 2, (m, k), generator=gen).float() * 2 - 1
    return rows * signs * 2.0 ** torch.randint(-3, 4, (m, 1), generator=gen).float()


def assert_same_or_at_ties(got: tuple, want: tuple, exact: bool) -> None:
    """Codes and scales equal (``exact``), else codes off by at most 1 at <= 1 % of the values, scales 1e-6 apart."""
    (codes, scales), (ref_codes, ref_scales) = got, want
    if exact:
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
        return
    assert (codes != ref_codes).float().mean() <= 0.01
    assert (codes.int() - ref_codes.int()).abs().max() <= 1
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)


def linear_args(k: int, n: int, gen: torch.Generator, transform: bool) -> dict:
    w = torch.randn(n, k, generator=gen)
    codes, scales = tile_weight(*quantize_weight(w))
    left, right = random_transform(k, gen) if transform else (None, None)
    inv_d = torch.rand(k, generator=gen) + 0.5
    return dict(w_codes=codes, w_scales=scales, n=n, left=left, right=right, inv_d=inv_d, clip=0.9)


DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32),
          pytest.param(torch.bfloat16, torch.bfloat16, marks=cuda_only)]  # fmt: skip


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "tensor-core"])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
@pytest.mark.parametrize("eps", [0.0, 1e-6, None])
@pytest.mark.parametrize(("m", "k"), [(1, 128), (3, 352), (20, 128), (33, 352)])
def test_folded_quantizer_is_bit_exact_on_exact_sums(m, k, eps, dtype, weight_dtype, exact, device):
    gen = torch.Generator().manual_seed(m * k)
    exact_rsqrt = device.type == "cpu" or eps == 0.0  # see the module docstring
    x = (integer_rows(m, k, gen) if device.type == "cpu" else power_rows(m, k, gen)).to(device, dtype)
    weight = (torch.rand(k, generator=gen) + 0.5).to(device, weight_dtype)
    left, right = (f.to(device) for f in random_transform(k, gen))
    inv_d = (torch.rand(k, generator=gen) + 0.5).to(device)
    decode = m <= 16
    args = (left, right, 0.9, 4, 32, exact, inv_d, decode)
    got = quantize_kernel.quantize_activation(x, *args, norm=(weight, eps))
    want = quantize_kernel.quantize_activation(rms_norm(x, weight, eps), *args)
    if device.type == "cuda" and not exact and dtype == torch.bfloat16 and exact_rsqrt and not _equal(got, want):
        # compiled, the tensor-core path's first tl.dot takes a bf16 x loaded from memory in another operand layout
        # than the normalised values computed in registers, so its tf32 MMAs round their sums at other points (as
        # the folded diagonal, test_quantize_kernel.py): the same codes, scales apart in their last bits (H100,
        # Triton 3.6, session 25: codes equal, scales not). The codes still must agree up to ties.
        assert_same_or_at_ties(got, want, exact=False)
        scales = ((got[1] - want[1]).abs() / want[1]).max().item()
        pytest.xfail(f"bf16 folded != unfolded on CUDA's tensor-core path: scales up to {scales:.2e} apart")
    assert_same_or_at_ties(got, want, exact_rsqrt)


def _equal(got: tuple, want: tuple) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("transform", [True, False])
@pytest.mark.parametrize("m", [1, 16, 17])
def test_folded_linear_equals_the_norm_then_the_linear(m, transform, device):
    """``quantized_linear`` with the norm, Triton backend (decode and prefill kernels) and torch backend, against the
    unfolded call on ``rms_norm(x)``: bit for bit where ``1 / rms`` is exact (the torch backend computes that same
    rms_norm)."""
    gen = torch.Generator().manual_seed(m + 100 * transform)
    k, n = 128, 48
    x = power_rows(m, k, gen).half().to(device)
    weight = (torch.rand(k, generator=gen) + 0.5).half().to(device)
    kwargs = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in linear_args(k, n, gen, transform).items()
    }
    for backend in ("triton", "torch"):
        got = ops.quantized_linear(x, **kwargs, backend=backend, norm_weight=weight, norm_eps=0.0)
        want = ops.quantized_linear(rms_norm(x, weight, 0.0), **kwargs, backend=backend)
        assert got.dtype == torch.float16 and torch.equal(got, want), backend


def test_random_rows_differ_at_most_at_ties(device):
    gen = torch.Generator().manual_seed(11)
    m, k = 40, 128
    x = (3 * torch.randn(m, k, generator=gen)).to(device)
    weight = (torch.rand(k, generator=gen) + 0.5).to(device)
    left, right = (f.to(device) for f in random_transform(k, gen))
    args = (left, right, 0.9, 8, 32, True, None, False)
    got = quantize_kernel.quantize_activation(x, *args, norm=(weight, 1e-6))
    want = quantize_kernel.quantize_activation(rms_norm(x, weight, 1e-6), *args)
    assert_same_or_at_ties(got, want, exact=False)


def test_bad_norm_weight_is_one_line():
    gen = torch.Generator().manual_seed(0)
    kwargs = linear_args(128, 16, gen, False)
    with pytest.raises(ValueError, match=r"norm_weight must be a floating \[K=128\] vector"):
        ops.quantized_linear(torch.randn(2, 128), **kwargs, backend="torch", norm_weight=torch.ones(64))
