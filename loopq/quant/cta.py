"""Cross-loop transition adapters (CTA, paper §4.3).

Before the state of loop t enters loop t+1 (t = 0..T-2):

    A_t(H) = H + (a_t - 1) * RMSNorm(H) + b_t + ((RMSNorm(H) V) * eta_t) U^T

U, V in R^{d x r} are shared across loops (rank r = 8 by default); a_t, b_t in R^d and eta_t in R^r are per
loop. Initialised as the identity map: a_t = 1, b_t = 0, eta_t = 0 (U and V start random so that eta_t receives
gradient at once). RMSNorm here has no weight of its own: a_t plays that role.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from loopq.kernels import rowwise_kernel
from loopq.models.base import rms_norm
from loopq.quant.slots import loop_slot


def transition_adapter(h: Tensor, a: Tensor, b: Tensor, eta: Tensor, u: Tensor, v: Tensor, eps: float) -> Tensor:
    """A_t(H) of §4.3 for one loop's parameters (pure function; shapes a, b: [d], eta: [r], u, v: [d, r])."""
    n = rms_norm(h, None, eps)
    return h + (a - 1) * n + b + ((n @ v) * eta) @ u.transpose(0, 1)


class TransitionAdapters(nn.Module):
    """A_0..A_{T-2} with shared low-rank directions; loops past the calibrated count reuse A_{T-2}."""

    def __init__(self, dim: int, num_loops: int, rank: int = 8, eps: float = 1e-6, seed: int = 0) -> None:
        super().__init__()
        if num_loops < 2:
            raise ValueError("transition adapters need num_loops >= 2 (there is no transition otherwise)")
        n = num_loops - 1
        gen = torch.Generator().manual_seed(seed)
        self.a = nn.Parameter(torch.ones(n, dim))
        self.b = nn.Parameter(torch.zeros(n, dim))
        self.eta = nn.Parameter(torch.zeros(n, rank))
        self.u = nn.Parameter(torch.randn(dim, rank, generator=gen) / dim**0.5)
        self.v = nn.Parameter(torch.randn(dim, rank, generator=gen) / dim**0.5)
        self.eps = eps

    @property
    def num_transitions(self) -> int:
        return self.a.shape[0]

    def forward(self, h: Tensor, t: int) -> Tensor:
        i = loop_slot(t, self.num_transitions)
        params = (self.a[i], self.b[i], self.eta[i], self.u, self.v)
        if rowwise_kernel.transition_applies(h, params):  # a GPU without autograd: one launch, not fifteen
            return rowwise_kernel.transition(h, *params, self.eps)
        x = h.to(torch.promote_types(h.dtype, self.a.dtype))  # fp32 compute (fp64 when the module is double)
        out = transition_adapter(x, self.a[i], self.b[i], self.eta[i], self.u, self.v, self.eps)
        return out.to(h.dtype)

    def loop_dependent_parameters(self) -> list[nn.Parameter]:
        return [self.a, self.b, self.eta]

    def shared_parameters(self) -> list[nn.Parameter]:
        return [self.u, self.v]
