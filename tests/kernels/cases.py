"""Inputs shared by the kernel tests: exact round-half ties and exactly invertible transforms; where they run."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from loopq.kernels import triton_interpreted, unpack_int4
from loopq.kernels.reference import gemm_fp64
from loopq.qspec import qrange
from loopq.quant.transforms import kron_factors

#: the compiled kernels run: a CUDA GPU and TRITON_INTERPRET unset or 0 (``python -m loopq.gpu_check``)
ON_CUDA = torch.cuda.is_available() and not triton_interpreted()
#: a case only the compiled kernels can run (bf16, which the interpreter lacks) or run fast (Ouro's real widths)
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="compiled kernels only: CUDA GPU with TRITON_INTERPRET=0")


def tie_tokens(m: int, k: int, bits: int, seed: int = 0) -> Tensor:
    """fp32 tokens whose groups quantize with scale exactly 1 (absmax = q_max, clip = 1) and whose values are
    exact .5 ties, their fp32 neighbours (e.g. 0.49999997) and integers - the hard cases of the rounding rule."""
    gen = torch.Generator().manual_seed(seed)
    qmax = qrange(bits)[1]
    halves = torch.arange(-qmax, qmax, dtype=torch.float32) + 0.5
    values = torch.cat(
        [
            halves,
            torch.nextafter(halves, torch.zeros(())),
            torch.nextafter(halves, torch.full((), 1e9)),
            torch.arange(-qmax, qmax + 1, dtype=torch.float32),
            torch.tensor([0.0, -0.0, 1e-30]),
        ]
    )
    z = values[torch.randint(len(values), (m, k), generator=gen)]
    z[:, ::32] = qmax * torch.where(torch.rand(m, k // 32, generator=gen) < 0.5, -1.0, 1.0)
    return z


def scaled_permutation(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A random signed permutation with power-of-two row scales and its exact inverse."""
    perm = torch.eye(n)[torch.randperm(n, generator=gen)]
    d = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0) * 2.0 ** torch.randint(-2, 3, (n,), generator=gen)
    return d[:, None] * perm, perm.T / d[None, :]


def random_transform(k: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Dense, non-orthogonal Kronecker factors of the size ``kron_factors(k)`` prescribes."""
    n1, n2 = kron_factors(k)
    return (
        torch.eye(n1) + 0.3 * torch.randn(n1, n1, generator=gen),
        torch.eye(n2) + 0.3 * torch.randn(n2, n2, generator=gen),
    )


def assert_within_bound(out: Tensor, a: Tensor, sa: Tensor, w: Tensor, sw: Tensor, bits: int) -> None:
    ref, bound = gemm_fp64(unpack_int4(a) if bits == 4 else a, sa, unpack_int4(w), sw)
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
