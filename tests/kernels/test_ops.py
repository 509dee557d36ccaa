"""Entry-point checks: bad inputs raise ValueError naming the argument; backend selection."""

import pytest
import torch

from loopq.kernels import (
    gemm_w4a4,
    gemm_w4a8,
    ops,
    pack_int4,
    quantize_activation,
    quantize_weight,
    triton_interpreted,
    unpack_int4,
)
from loopq.kernels.packing import tile_weight

X = torch.randn(4, 128)
A4, A8 = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 128, dtype=torch.int8)
W = torch.zeros(40, 64, dtype=torch.uint8)
SA, SW = torch.ones(4, 4), torch.ones(40, 4, dtype=torch.float16)

BAD_CALLS = {
    "x 3-D": (lambda: quantize_activation(X[None]), "x must be a 2-D"),
    "x int": (lambda: quantize_activation(X.int()), "x must have dtype"),
    "bits": (lambda: quantize_activation(X, bits=3), "bits=3"),
    "clip": (lambda: quantize_activation(X, clip=0.0), "clip=0.0"),
    "ragged K": (lambda: quantize_activation(torch.randn(2, 100)), "K=100"),
    "triton group": (lambda: quantize_activation(X, group_size=64, backend="triton"), "group_size=64"),
    "backend name": (lambda: quantize_activation(X, backend="cuda"), "backend='cuda'"),
    "left size": (lambda: quantize_activation(X, torch.eye(3), None), "left must be square"),
    "factor mismatch": (lambda: quantize_activation(X, torch.eye(8), torch.eye(8)), "does not match K=128"),
    "a dtype": (lambda: gemm_w4a4(A8, SA, W, SW), "a_packed must have dtype"),
    "w dtype": (lambda: gemm_w4a8(A8, SA, W.to(torch.int8), SW), "w_packed must have dtype"),
    "K mismatch": (lambda: gemm_w4a4(A4[:, :32], SA, W, SW), "w_packed has K=128"),
    "scale cols": (lambda: gemm_w4a4(A4, SA[:, :2], W, SW), "a_scales"),
    "scale rows": (lambda: gemm_w4a8(A8, SA, W, SW[:5]), "w_scales"),
    "out dtype": (lambda: gemm_w4a4(A4, SA, W, SW, torch.int32), "out_dtype"),
    "gemm triton group": (lambda: gemm_w4a4(A4, SA[:, :2], W, SW[:, :2], backend="triton"), "group_size"),
    # the decode kernel reads float16 scales: fp32 ones were rounded there, 100x outside the documented bound
    "gemm triton scales": (lambda: gemm_w4a8(A8, SA, W, SW.float(), backend="triton"), "float16 weight scales"),
    "pack range": (lambda: pack_int4(torch.tensor([8, 0], dtype=torch.int8)), r"\[-8, 7\]"),
    "pack odd": (lambda: pack_int4(torch.zeros(3, dtype=torch.int8)), "must be even"),
    "pack dtype": (lambda: pack_int4(torch.zeros(4, dtype=torch.int32)), "codes must be int8"),
    "unpack dtype": (lambda: unpack_int4(torch.zeros(4, dtype=torch.int8)), "packed must be uint8"),
    "weight bits": (lambda: quantize_weight(torch.randn(8, 64), bits=8), "bits=8"),
    "weight clip": (lambda: quantize_weight(torch.randn(8, 64), torch.ones(3)), "clip_ratio"),
    "weight group": (lambda: quantize_weight(torch.randn(8, 48), group_size=32), "group_size=32"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_raises_value_error(case):
    call, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.skipif(not triton_interpreted(), reason="interpreter-only limitation")
def test_interpreter_rejects_bfloat16():
    with pytest.raises(ValueError, match="bfloat16"):
        gemm_w4a4(A4, SA, W, SW, torch.bfloat16, backend="triton")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(ops, "triton_interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quantize_activation(X, backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bits", [4, 8])
def test_an_empty_batch_gives_an_empty_output(backend, bits, device):
    """Zero tokens (an empty batch) is a legitimate call: every backend returns ``[0, N]`` (the torch reference's
    reshape could not infer its group size from zero rows), on the kernels' device."""
    w, sw = quantize_weight(torch.randn(40, 128, device=device))
    a, sa = quantize_activation(torch.randn(0, 128, device=device), bits=bits)
    out = (gemm_w4a4 if bits == 4 else gemm_w4a8)(a, sa, w, sw, backend=backend)
    assert out.shape == (0, 40) and out.device == w.device
    codes, scales = tile_weight(w, sw)
    y = ops.quantized_linear(torch.randn(0, 128, device=device), codes, scales, 40, a_bits=bits, backend=backend)
    assert y.shape == (0, 40)


def test_default_backend_is_torch_on_cpu(monkeypatch):
    monkeypatch.setitem(ops._QUANTIZE, "triton", None)  # would fail if dispatched
    codes, scales = quantize_activation(X)
    assert codes.shape == (4, 64) and scales.shape == (4, 4)
