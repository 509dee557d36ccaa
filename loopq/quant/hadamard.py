"""Hadamard matrices and the randomized Hadamard rotations of QuaRot / SpinQuant (pure functions).

A Hadamard matrix H of order n has entries +-1 and H H^T = n I, so H / sqrt(n) is orthogonal and spreads every
input channel evenly over all outputs - the incoherence that QuaRot (Ashkboos et al., 2024, "QuaRot: Outlier-Free
4-Bit Inference in Rotated LLMs") uses to remove activation outliers before quantization. Its *randomized* form
flips the input signs first: x R with R = diag(s) H / sqrt(n), s in {-1, +1}^n.

Orders built here (:func:`hadamard`): n = 2^k (Sylvester), and n = 2^k (q + 1) for a prime q = 3 (mod 4)
(Sylvester (x) Paley construction I) - e.g. 12 (q = 11), 20 (q = 19), 24 (q = 23), 88 = 2 * 44 (q = 43). Hadamard
matrices exist only for n in {1, 2} and multiples of 4; for an order without one (e.g. 10) or one this module does
not construct (e.g. 36, 92), :func:`randomized_hadamard` falls back to a random orthogonal matrix (Haar, from QR),
which keeps the transform exactly invertible but spreads outliers only statistically.

In the framework a group's transform is a Kronecker product P1 (x) P2 of two factors (the layout the exported
kernels run online), so QuaRot's rotation of width n = n1 n2 is R1 (x) R2 with one randomized Hadamard per factor:
(D1 H1) (x) (D2 H2) = (D1 (x) D2)(H1 (x) H2) - a Hadamard of order n whose sign vector is s1 (x) s2 (n1 + n2 random
signs instead of n). Sylvester and Paley matrices are closed under (x), so H1 (x) H2 is itself a Hadamard matrix.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def sylvester(n: int) -> Tensor:
    """The Sylvester Hadamard matrix of order ``n = 2^k`` (float64)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester's construction needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64, device="cpu")
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64, device="cpu")
    while h.shape[0] < n:
        h = torch.kron(h, base)
    return h


def paley(q: int) -> Tensor:
    """Paley construction I: a Hadamard matrix of order q + 1 for a prime q = 3 (mod 4) (float64).

    With the quadratic character chi of GF(q) and the Jacobsthal matrix Q_ij = chi(j - i) (skew-symmetric for
    q = 3 mod 4), H = I + [[0, 1^T], [-1, Q]].
    """
    if not is_prime(q) or q % 4 != 3:
        raise ValueError(f"Paley construction I needs a prime q = 3 (mod 4), got {q}")
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=torch.float64, device="cpu")
    idx = torch.arange(q, device="cpu")
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64, device="cpu")
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, jacobsthal
    return torch.eye(q + 1, dtype=torch.float64, device="cpu") + s


def hadamard(n: int) -> Tensor | None:
    """A Hadamard matrix of order ``n`` (float64): 2^k, or 2^k (q + 1) with q prime = 3 (mod 4); else None."""
    power = 1
    while n % power == 0:
        core = n // power
        if core == 1:
            return sylvester(power)
        if core % 4 == 0 and is_prime(core - 1):
            return torch.kron(sylvester(power), paley(core - 1))
        power *= 2
    return None


def random_orthogonal(n: int, generator: torch.Generator) -> Tensor:
    """A Haar-random orthogonal matrix (QR of a Gaussian with the signs of R's diagonal fixed), float32."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64, device=generator.device))
    return (q * torch.sign(torch.diagonal(r))).float()


def randomized_hadamard(n: int, generator: torch.Generator) -> Tensor:
    """QuaRot's rotation diag(s) H / sqrt(n) with random signs s (float32, orthogonal); a random orthogonal
    matrix when :func:`hadamard` has no matrix of order ``n`` (see the module docstring)."""
    h = hadamard(n)
    if h is None:
        return random_orthogonal(n, generator)
    signs = torch.randint(0, 2, (n,), generator=generator, device=generator.device).double() * 2 - 1
    return (signs[:, None] * h / math.sqrt(n)).float()
