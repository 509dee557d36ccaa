"""A non-finite number is an error, never a result.

A model with a NaN or inf among its weights (a diverged calibration, a damaged or hand-edited file) produces NaN
logits everywhere they reach: perplexity then comes out ``NaN`` - written to a results JSON with exit status 0 - and
greedy decoding picks token 0 (``argmax`` of all-NaN logits), often the end-of-text token, which reads as the model
choosing to stop. :func:`nonfinite_error` turns either into one error naming the cause: the first tensor of the
model holding a NaN or inf, or, when every tensor is finite, activations that overflowed. The model's tensors are
scanned only once an output was found non-finite, so a healthy run pays nothing.
"""

from __future__ import annotations

from torch import nn

from loopq.errors import LoopLMError


def first_nonfinite(model: nn.Module) -> str | None:
    """The name of the first floating-point parameter or buffer of ``model`` holding a NaN or inf, else None."""
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(tensor.isfinite().all()):
            return name
    return None


def nonfinite_error(model: nn.Module, what: str) -> LoopLMError:
    """The error for a non-finite ``what`` (e.g. ``WikiText-2 perplexity``) computed by ``model``, naming the cause."""
    name = first_nonfinite(model)
    if name is not None:
        cause = (
            f"the model's tensor {name!r} holds NaN/inf values (a diverged calibration or a damaged file); "
            "recalibrate, re-export or re-download the model"
        )
    else:
        cause = "every weight is finite, so its activations overflowed; evaluate in float32 or with fewer loops"
    return LoopLMError(f"{what} is not finite (NaN or inf): {cause}; no result was reported")
