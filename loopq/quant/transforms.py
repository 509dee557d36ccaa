"""FlatQuant-style invertible Kronecker transforms (paper Eq. 2-3), never materialising the Kronecker product.

A channel vector x in R^n (n = n1 * n2, n1 <= n2 the factor pair closest to sqrt(n)) is viewed as a matrix
X in R^{n1 x n2}; the transform with P = P1 (x) P2 and a per-channel diagonal scale d is

    x' = (x / d) P        computed as   P1^T X_d P2                  (activation side, online)
    W' = (W * d) P^{-T}   computed as   P1^{-1} W_row,d P2^{-T}      (weight side, folded at export)

so that x' W'^T = x W^T exactly: with quantization off the student equals the teacher.

Invertibility is preserved by construction: each factor is P_i = U_i diag(exp(s_i)) V_i^T with U_i, V_i
orthogonal (matrix exponentials of skew-symmetric parameters), so det P_i != 0 for every parameter value and
P_i^{-1} = V_i diag(exp(-s_i)) U_i^T in closed form. The diagonal scale is d = exp(log_d) > 0.

A factor is any module with ``matrix()``, ``inverse()`` and ``matrix_and_inverse()``: besides the learnable
:class:`FactorMatrix`, the baselines use a frozen :class:`FixedFactor` (SmoothQuant's identity, QuaRot's randomized
Hadamard) and a :class:`CayleyFactor` (SpinQuant's learned rotation). The fake-quant group, the float64 fold and
the exporter read factors only through these three methods.

**Autocast.** Under ``torch.autocast`` (``bf16-mixed``, the paper configs) a matmul casts its fp32 operands to bf16,
which would compute the factors and both transforms with 8-bit mantissas while the export computes them in fp32
(activations: the quantizer kernel) and float64 (weights): 0.9 % of the 4-bit and 16 % of the 8-bit activation codes
differed from the export's on a random Ouro-width row block, and P^{-1} stopped being the inverse of P. The
transforms' matmuls therefore run with autocast off (:func:`transform_precision`), and under autocast the
transformed activation stays fp32 up to its quantizer, as the kernel quantizes it.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import Tensor, nn

from loopq.qspec import at_least_fp32


def kron_factors(n: int) -> tuple[int, int]:
    """The factor pair (n1, n2), n1 * n2 = n, n1 <= n2, with n1 closest to sqrt(n)."""
    n1 = math.isqrt(n)
    while n % n1:
        n1 -= 1
    return n1, n // n1


def autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is active for ``device_type`` (CPU and CUDA; other devices have none here)."""
    return device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)


def transform_precision(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off around the transforms' matmuls, so they run in their operands' (at least fp32) dtype as the
    export computes them (module docstring); nothing to do where autocast is not on."""
    return torch.autocast(device_type, enabled=False) if autocast_on(device_type) else contextlib.nullcontext()


def kron_apply(x: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """``x (left (x) right)`` for row vectors in ``x[..., n]``: viewed as ``X [.., n1, n2]``, ``left^T X right``.

    Computed as two plain 2-D matmuls over all rows at once (``X right`` on ``[N n1, n2]``, then ``left^T`` on
    the ``[n1, N n2]`` transpose) instead of a broadcast batched matmul: a third of the dispatched ops.
    """
    n1, n2 = left.shape[0], right.shape[0]
    # the factors in the promoted dtype: a model cast to bf16/fp16 keeps the fp32 math of ``at_least_fp32`` (its
    # narrow factors are widened, never the rows narrowed); the matmuls with autocast off (module docstring)
    dtype = torch.promote_types(x.dtype, torch.promote_types(left.dtype, right.dtype))
    x, left, right = x.to(dtype), left.to(dtype), right.to(dtype)
    with transform_precision(x.device.type):
        y = (x.reshape(-1, n2) @ right).reshape(-1, n1, n2)
        y = left.transpose(0, 1) @ y.transpose(0, 1).reshape(n1, -1)
    return y.reshape(n1, -1, n2).transpose(0, 1).reshape(x.shape)


def transform_activation(x: Tensor, p1: Tensor | None, p2: Tensor | None, inv_d: Tensor | None) -> Tensor:
    """(x * inv_d)(P1 (x) P2) in (at least) fp32, cast back to x's dtype (activation side of Eq. 2-3) - except under
    autocast, where it stays fp32 for the quantizer, as the export's kernel quantizes it (module docstring)."""
    z = at_least_fp32(x)
    if inv_d is not None:
        z = z * inv_d
    if p1 is not None and p2 is not None:
        z = kron_apply(z, p1, p2)
    return z if autocast_on(z.device.type) else z.to(x.dtype)


def orthogonal(skew_param: Tensor) -> Tensor:
    """An orthogonal matrix exp(A - A^T) (identity at A = 0)."""
    return torch.linalg.matrix_exp(skew_param - skew_param.transpose(0, 1))


class FactorMatrix(nn.Module):
    """One invertible factor P = U diag(exp(s)) V^T, with its closed-form inverse."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.zeros(n, n))
        self.v = nn.Parameter(torch.zeros(n, n))
        self.log_s = nn.Parameter(torch.zeros(n))

    def matrix(self) -> Tensor:
        return self.matrix_and_inverse()[0]

    def inverse(self) -> Tensor:
        return self.matrix_and_inverse()[1]

    def matrix_and_inverse(self) -> tuple[Tensor, Tensor]:
        """(P, P^{-1}) with each orthogonal factor evaluated once (two matrix exponentials, not four)."""
        # in (at least) fp32: a factor cast to bf16/fp16 with the model would take its matrix exponentials in bf16
        u, v, log_s = at_least_fp32(self.u), at_least_fp32(self.v), at_least_fp32(self.log_s)
        with transform_precision(u.device.type):  # under autocast too (module docstring)
            u, v = orthogonal(u), orthogonal(v)
            return u * log_s.exp() @ v.transpose(0, 1), v * (-log_s).exp() @ u.transpose(0, 1)

    def randomize_(self, generator: torch.Generator, scale: float = 0.3) -> None:
        """A random invertible, non-orthogonal factor (tests of function preservation)."""
        with torch.no_grad():
            for p in (self.u, self.v):
                p.copy_(torch.randn(p.shape, generator=generator, device=generator.device) * scale)
            self.log_s.copy_(torch.randn(self.log_s.shape, generator=generator, device=generator.device) * scale)


class FixedFactor(nn.Module):
    """A frozen orthogonal factor R (a buffer, rebuilt by ``prepare`` from the config's seed), R^{-1} = R^T."""

    def __init__(self, matrix: Tensor) -> None:
        super().__init__()
        self.register_buffer("r", matrix.detach().clone())

    def matrix(self) -> Tensor:
        return self.r

    def inverse(self) -> Tensor:
        return self.r.transpose(0, 1)

    def matrix_and_inverse(self) -> tuple[Tensor, Tensor]:
        return self.r, self.r.transpose(0, 1)


def cayley(skew: Tensor) -> Tensor:
    """The Cayley transform (I - A)^{-1} (I + A) of a skew-symmetric A: orthogonal, identity at A = 0."""
    eye = torch.eye(skew.shape[0], dtype=skew.dtype, device=skew.device)
    return torch.linalg.solve(eye - skew, eye + skew)


class CayleyFactor(nn.Module):
    """A learned rotation R = R0 Cayley(M - M^T) (SpinQuant, Liu et al., 2025), R^{-1} = R^T.

    R0 is a frozen orthogonal start (QuaRot's randomized Hadamard), reached at M = 0; every M gives an orthogonal R
    (I - A is invertible for skew A), so plain AdamW on M stays on the rotations. SpinQuant itself optimises R with
    Cayley SGD on the Stiefel manifold; this parameterisation reaches the same set with the framework's optimizer.
    """

    def __init__(self, base: Tensor) -> None:
        super().__init__()
        self.register_buffer("base", base.detach().clone())
        self.skew = nn.Parameter(torch.zeros_like(self.base))

    def matrix(self) -> Tensor:
        return self.matrix_and_inverse()[0]

    def inverse(self) -> Tensor:
        return self.matrix_and_inverse()[1]

    def matrix_and_inverse(self) -> tuple[Tensor, Tensor]:
        skew = at_least_fp32(self.skew)  # the solve in (at least) fp32, as FactorMatrix's exponentials
        with transform_precision(skew.device.type):
            r = at_least_fp32(self.base) @ cayley(skew - skew.transpose(0, 1))
        return r, r.transpose(0, 1)


class KroneckerTransform(nn.Module):
    """The learnable per-group transform (P1 (x) P2 with diagonal scale d) of one transform-weight group."""

    def __init__(self, n: int, diag_scale: bool = True) -> None:
        super().__init__()
        n1, n2 = kron_factors(n)
        self.n = n
        self.left = FactorMatrix(n1)
        self.right = FactorMatrix(n2)
        self.log_d = nn.Parameter(torch.zeros(n)) if diag_scale else None

    def matrices(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(P1, P2, P1^{-1}, P2^{-1})."""
        (p1, p1_inv), (p2, p2_inv) = self.left.matrix_and_inverse(), self.right.matrix_and_inverse()
        return p1, p2, p1_inv, p2_inv

    def activation(self, x: Tensor, p1: Tensor, p2: Tensor, inv_d: Tensor | None = None) -> Tensor:
        """x' = (x / d) (P1 (x) P2), computed in (at least) fp32 and cast back (``inv_d``: e^{-log d} if computed)."""
        if self.log_d is not None and inv_d is None:
            inv_d = (-self.log_d).exp()
        return transform_activation(x, p1, p2, inv_d)

    def weight(self, w: Tensor, p1_inv: Tensor, p2_inv: Tensor) -> Tensor:
        """W' = (W * d) (P1 (x) P2)^{-T} for rows of ``w [out, n]`` (at least fp32)."""
        w32 = at_least_fp32(w)
        if self.log_d is not None:
            w32 = w32 * self.log_d.exp()
        return kron_apply(w32, p1_inv.transpose(0, 1), p2_inv.transpose(0, 1))

    def randomize_(self, generator: torch.Generator, scale: float = 0.3) -> None:
        self.left.randomize_(generator, scale)
        self.right.randomize_(generator, scale)
        if self.log_d is not None:
            with torch.no_grad():
                self.log_d.copy_(torch.randn(self.n, generator=generator, device=generator.device) * scale)


def fold_weight(weight: Tensor, transform: KroneckerTransform | None) -> Tensor:
    """``W' = (W * d) (P1^{-1} (x) P2^{-1})^T`` for rows of ``weight [out, n]``, folded in float64, returned fp32.

    This is what the exporter writes; the fake-quant group's fp32 path differs from it by rounding only.
    """
    w = weight.double()
    if transform is None:
        return w.float()
    tr = copy.deepcopy(transform).double()
    if tr.log_d is not None:
        w = w * tr.log_d.exp()
    return kron_apply(w, tr.left.inverse().transpose(0, 1), tr.right.inverse().transpose(0, 1)).float()
