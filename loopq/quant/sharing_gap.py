"""The sharing-gap score (paper §4.2): which transform-weight groups resist sharing one transform across loops.

For group l with per-loop gradients phi_{t,l,j} of the loss w.r.t. its shared transform (j runs over the
transform's coordinates) and a diagonal-Fisher curvature estimate psi_{l,j}:

    S_l = sum_j Var_t(phi_{t,l,j}) / (psi_{l,j} + eps),
    Var_t(phi) = (1/T) sum_t phi_t^2 - ((1/T) sum_t phi_t)^2.

Large S_l: the loops pull the shared transform in incompatible directions (after curvature normalisation), so
the group profits most from loop-dependent transforms. Several gradient batches are combined by averaging
phi and psi first (see :class:`SharingGapAccumulator`).
"""

from __future__ import annotations

from torch import Tensor


def sharing_gap(phi: Tensor, psi: Tensor, eps: float = 1e-8) -> Tensor:
    """S_l from per-loop gradients ``phi [T, J]`` and curvature ``psi [J]`` (a scalar tensor)."""
    variance = phi.pow(2).mean(dim=0) - phi.mean(dim=0).pow(2)
    return (variance / (psi + eps)).sum()


def fisher_diagonal(phi: Tensor) -> Tensor:
    """The curvature term of Eq. 6 from one batch's gradient: (sum_t phi_t)^2, shape [J].

    The gradient w.r.t. the *shared* parameter is the sum of its per-loop contributions. ``phi`` is the gradient of
    the batch's *mean* loss, so this is the square of a mini-batch gradient - a proxy of the paper's diagonal Fisher
    E_x[g(x)^2] (per sample), whose expectation is E[g]^2 + Var(g) / B; a documented deviation
    (docs/design-notes.md, "SLT and the sharing gap").
    """
    return phi.sum(dim=0).pow(2)


class SharingGapAccumulator:
    """Averages gradients over batches: phi_t = E_batch[phi_{b,t}] (the gradient of the expected loss) and
    psi = E_batch[(sum_t phi_{b,t})^2] (the squared mini-batch gradient, see :func:`fisher_diagonal`); ``score()``
    is S_l on those."""

    def __init__(self) -> None:
        self.phi: Tensor | None = None
        self.psi: Tensor | None = None
        self.count = 0

    def add(self, phi: Tensor) -> None:
        phi = phi.detach().double()
        psi = fisher_diagonal(phi)
        self.phi = phi if self.phi is None else self.phi + phi
        self.psi = psi if self.psi is None else self.psi + psi
        self.count += 1

    def score(self, eps: float = 1e-8) -> float:
        if self.phi is None or self.psi is None:
            raise ValueError("no gradients were accumulated")
        return float(sharing_gap(self.phi / self.count, self.psi / self.count, eps))
