"""One arithmetic on every device: scales and codes are IEEE fp32 divisions by tensors (loopq.qspec's docstring).

On CPU both ``tensor / 7`` and ``tensor / tensor(7.)`` divide, so a regression to a Python-number divisor would
pass an equality test here and fail on CUDA (which multiplies by the reciprocal there). The expression is pinned
twice: bit-exact against a float64 oracle (correctly rounded division; double rounding through float64 is exact
for fp32 quotients), and by recording every division the quantizers make and refusing Python-number divisors.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from loopq.kernels.reference import quantize_activation
from loopq.qspec import group_scales, quantize_codes, to_groups
from loopq.quant.primitives import fake_quant, row_clip_errors

DIVISIONS = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide, torch.Tensor.div_}


class RecordDivisions(TorchFunctionMode):
    """Every division's divisor, as called (a Tensor, or the Python number CUDA would turn into a reciprocal)."""

    def __init__(self) -> None:
        super().__init__()
        self.divisors: list[object] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DIVISIONS:
            self.divisors.append(args[1] if len(args) > 1 else kwargs.get("other"))
        return func(*args, **kwargs)


def _samples() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=gen) * torch.logspace(-3, 3, 256)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("clip", [1.0, 0.87])
def test_scales_are_correctly_rounded_divisions(bits, clip):
    groups = to_groups(_samples(), 32)
    scaled = groups.abs().amax(dim=-1, keepdim=True) * clip
    want = (scaled.double() / (2 ** (bits - 1) - 1)).float().clamp_min(1e-8)
    assert torch.equal(group_scales(groups, bits, clip), want)
    # the reciprocal product CUDA makes of ``/ q_max`` is another number in some scales (~half at 4 bits): the oracle
    # tells the two expressions apart
    reciprocal = scaled * (1.0 / (2 ** (bits - 1) - 1))
    assert (reciprocal != want).any()


def test_codes_are_round_half_even_of_correctly_rounded_quotients():
    x = _samples()
    codes, scales = quantize_codes(x, 4, 32)
    quotient = (to_groups(x, 32).double() / scales.unsqueeze(-1).double()).float()
    want = torch.round(quotient).clamp(-8, 7).to(torch.int8).reshape(x.shape)
    assert torch.equal(codes, want)


@pytest.mark.parametrize(
    "quantize",
    [
        lambda x: quantize_codes(x, 4, 32),
        lambda x: fake_quant(x, 4, 32, torch.tensor(0.9)),
        lambda x: fake_quant(x, 8, 32, 0.9),
        lambda x: row_clip_errors(x, 4, 32, torch.linspace(0.5, 1.0, 3)),
        lambda x: quantize_activation(x, torch.eye(16), torch.eye(16), 0.9, 4, 32),
    ],
    ids=["codes", "fake_quant_tensor_clip", "fake_quant_float_clip", "weight_clip_search", "kernel_reference"],
)
def test_no_division_by_a_python_number(quantize):
    with RecordDivisions() as mode:
        quantize(_samples())
    assert mode.divisors, "the recorder saw no division: it no longer observes the quantizer"
    assert all(isinstance(d, torch.Tensor) for d in mode.divisors), mode.divisors
