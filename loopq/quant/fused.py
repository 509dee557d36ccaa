"""The per-call quantizer chain of a fake-quant group, optionally fused by ``torch.compile``.

Every linear input of every loop goes through (paper Eq. 2-4) ``x -> x / d -> (P1 (x) P2) -> Q_a``, and every
forward's weights through ``Q_w``: about thirty elementwise ops forward and backward over the full activation,
each a separate pass over memory in eager mode. With ``model.compile_quantizers: true`` both chains run as
``torch.compile``-d functions (Inductor: fused C++ loops on CPU, Triton kernels on GPU). Measured on this CPU for a
[512, 1024] activation, group 32: forward+backward 11.9 ms eager -> 2.6 ms compiled, the same outputs and gradients
to 1e-6 (the fused reductions sum in another order). Compilation costs ~20-45 s per distinct shape on this machine
(paid once per run; SLT promotion changes no shape, so nothing recompiles), so it is off by default and meant for
real calibrations, not for the tiny CPU default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from loopq.quant.primitives import fake_quant
from loopq.quant.transforms import transform_activation


def transform_quantize(
    x: Tensor,
    p1: Tensor | None,
    p2: Tensor | None,
    inv_d: Tensor | None,
    clip: Tensor,
    bits: int,
    group_size: int,
) -> Tensor:
    """Q_a((x / d)(P1 (x) P2)): the transform in (at least) fp32, cast back, then dynamic fake quantization."""
    return fake_quant(transform_activation(x, p1, p2, inv_d), bits, group_size, clip)


#: distinct (shape, dtype, grad mode) variants a chain may be compiled for before Dynamo falls back to eager: a
#: model has a few input widths and weight shapes, times training/evaluation batch shapes
RECOMPILE_LIMIT = 64


@functools.cache
def compiled(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """One shared ``torch.compile`` of ``fn`` for every group, one graph per distinct shape: static shapes, because
    the per-loop checkpointed recomputation must reproduce the forward's tensor metadata exactly (automatic dynamic
    shapes recompile it differently and ``torch.utils.checkpoint`` rejects the recomputation).

    Dynamo's recompile limit is raised to :data:`RECOMPILE_LIMIT` only around the calls of these functions
    (``torch._dynamo.config.patch``), never for the rest of the process."""
    graph = torch.compile(fn, dynamic=False)

    @functools.wraps(fn)
    def call(*args: Any) -> Tensor:
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return graph(*args)

    return call


def quantizers(compile_: bool) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
    """(activation chain, weight fake-quant): eager or compiled."""
    if compile_:
        return compiled(transform_quantize), compiled(fake_quant)
    return transform_quantize, fake_quant
