"""The fused fake quantization of calibration (``loopq.kernels.fake_quant_kernel``; CPU interpreter with the CPU
added to its devices, CUDA with TRITON_INTERPRET=0) against the torch ops of ``loopq.quant.primitives.fake_quant``.

Oracles: the forward is the torch ops' value bit for bit (ties at .5, zeros, an all-zero group at the scale floor, a
clip small enough to clamp, NaN / inf); the backward is the torch ops' autograd gradient bit for bit for every value
that is not its group's maximum, and for the maxima and the clip within the fp32 rounding of the two sums over a
group (``gamma_32`` of the summed magnitudes, then carried through the same products and divisions, and the clip's
sum over its groups: ``gamma_G``), with several equal maxima splitting the gradient as ``amax`` does.
"""

import pytest
import torch

from loopq.kernels import fake_quant_kernel as fq
from loopq.qspec import qrange
from loopq.quant import primitives
from tests.kernels.cases import ON_CUDA

U = 2.0**-24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


@pytest.fixture
def kernels_on(device, monkeypatch):
    """The fused kernels for ``device`` (the interpreter's CPU too)."""
    monkeypatch.setattr(fq, "DEVICES", {"cuda", "cpu"})
    return device


def torch_fake_quant(x: torch.Tensor, bits: int, clip: torch.Tensor) -> torch.Tensor:
    """``primitives.fake_quant``'s torch ops, whatever ``fq.applies`` says."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    scales = primitives.group_scales(groups, bits, clip)
    qmin, qmax = qrange(bits)
    return (scales * primitives.round_ste(groups / scales).clamp(qmin, qmax)).reshape(x.shape)


def inputs(rows: int, k: int, device, seed: int = 0, per_row: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(rows, k, generator=gen)
    x[0, :32] = torch.arange(-16, 16) / 2  # .5 ties at clip 1 (scale 8 / 7 is not 1: a mix of exact values)
    x[1, :32] = 0.0  # an all-zero group: the scale floor
    x[1, 32:64] *= 1e-9  # a nonzero group below the floor: no gradient reaches its scale
    if rows > 3:
        x[2, 32:64] = x[2, 32:64].abs().max() * torch.where(torch.arange(32) % 5 == 0, 1.0, 0.3)  # equal maxima
        x[3, :32] *= -1
    logits = torch.randn(rows if per_row else (), generator=gen)
    clip = torch.sigmoid(logits).reshape(-1, 1, 1) if per_row else torch.sigmoid(logits)
    return x.to(device), clip.to(device)


def test_applies_to_what_it_should(kernels_on):
    device = kernels_on
    x, clip = inputs(4, 64, device)
    assert fq.applies(x, 4, 32, clip) and fq.applies(x, 8, 32, clip.reshape(1, 1))
    assert fq.applies(x, 4, 32, torch.full((4, 1, 1), 0.9, device=device))
    assert not fq.applies(x, 4, -1, clip) and not fq.applies(x, 4, 16, clip)  # other group sizes: torch ops
    assert not fq.applies(x.double(), 4, 32, clip.double()) and not fq.applies(x.half(), 4, 32, clip)
    assert not fq.applies(x.t(), 4, 32, clip)  # not contiguous
    assert not fq.applies(x, 4, 32, 0.9) and not fq.applies(x, 16, 32, clip)  # a float clip; 16 bits: identity
    assert not fq.applies(x, 4, 32, torch.full((4, 2, 1), 0.9, device=device))  # not a per-row clip
    assert not fq.applies(x[:, :48].contiguous(), 4, 32, clip)  # K not whole groups
    x3 = x.reshape(2, 2, 64)
    assert fq.applies(x3, 4, 32, clip) and not fq.applies(x3, 4, 32, torch.full((2, 1, 1), 0.9, device=device))


@pytest.mark.skipif(ON_CUDA, reason="the default devices, on a CPU")
def test_the_cpu_keeps_the_torch_ops(monkeypatch):
    """Without the test's opt-in a CPU tensor never takes the kernels: the CPU results stand as measured."""
    x, clip = inputs(4, 64, "cpu")
    assert not fq.applies(x, 4, 32, clip)
    monkeypatch.setattr(fq, "forward", lambda *a: pytest.fail("kernel launched on the CPU"))
    primitives.fake_quant(x, 4, 32, clip)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("per_row", [False, True], ids=["activation", "weight"])
def test_forward_is_the_torch_ops_value_bit_for_bit(kernels_on, bits, per_row):
    x, clip = inputs(37, 96, kernels_on, seed=bits, per_row=per_row)
    got = primitives.fake_quant(x, bits, 32, clip)  # dispatches to the kernel
    want = torch_fake_quant(x, bits, clip)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 where torch rounds to it


def test_forward_with_nan_inf_and_a_tiny_clip(kernels_on):
    x, _ = inputs(3, 64, kernels_on)
    x[0, 3], x[1, 40], x[2, 50] = float("nan"), float("inf"), -float("inf")
    clip = torch.tensor(1e-30, device=kernels_on)  # every scale at the floor
    for c in (clip, torch.tensor(0.7, device=kernels_on)):
        torch.testing.assert_close(fq.forward(x, c, 4), torch_fake_quant(x, 4, c), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("per_row", [False, True], ids=["activation", "weight"])
def test_backward_is_autograds_up_to_the_group_sums(kernels_on, per_row, bits):
    x, clip = inputs(37, 96, kernels_on, seed=3, per_row=per_row)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(kernels_on)
    qmax = qrange(bits)[1]
    grads = []
    for fn in (lambda a, c: primitives.fake_quant(a, bits, 32, c), lambda a, c: torch_fake_quant(a, bits, c)):
        a, c = x.clone().requires_grad_(True), clip.clone().requires_grad_(True)
        fn(a, c).backward(gy)
        grads.append((a.grad, c.grad))
    (gx, gc), (want_x, want_c) = grads
    groups = x.reshape(-1, 32)
    is_max = groups.abs() == groups.abs().amax(1, keepdim=True)
    off_max = ~is_max.reshape(x.shape)
    assert torch.equal(gx[off_max], want_x[off_max])  # the same elementwise operations
    # the maxima: the group's two sums (gamma_32 of their magnitudes), times clip / (q_max count); bound the
    # magnitude by the whole group's |gy| (q_max + 1 + |x / s|) / q_max, a generous majorant of both sums' terms
    per_group = x.shape[1] // 32
    clip_g = clip.reshape(-1).repeat_interleave(per_group) if per_row else clip.reshape(1).expand(len(groups))
    clip_g = clip_g.reshape(-1, 1)
    s = primitives.group_scales(groups, bits, clip_g)
    magnitude = (gy.reshape(-1, 32).abs() * (qmax + 1 + (groups / s).abs())).sum(1, keepdim=True) / qmax
    bound = 4 * gamma(32) * magnitude * clip_g
    diff = (gx - want_x).reshape(-1, 32).abs()
    assert bool((diff <= bound + 1e-30).all()), float((diff - bound).max())
    # the clip: the same sums times absmax / q_max, then the sum over its groups
    clip_mag = (magnitude * groups.abs().amax(1, keepdim=True)).reshape(-1)
    n = clip_mag.numel() // gc.numel()
    clip_bound = (4 * gamma(32) + gamma(n)) * clip_mag.reshape(gc.numel(), n).sum(1)
    assert bool(((gc - want_c).abs().reshape(-1) <= clip_bound).all())


def test_a_nan_gradient_spreads_as_autograds_does(kernels_on):
    """A NaN in ``grad_y`` reaches its group's scale, and through ``amax``'s ``(grad / count) * mask`` every value of
    the group (torch multiplies, so NaN * 0 is NaN): the same NaN positions, the other groups' gradients equal."""
    x, clip = inputs(4, 64, kernels_on, seed=5)
    gy = torch.ones_like(x)
    gy[0, 5] = float("nan")
    grads = []
    for fn in (lambda a: fq.fake_quant(a, clip, 4), lambda a: torch_fake_quant(a, 4, clip)):
        a = x.clone().requires_grad_(True)
        fn(a).backward(gy)
        grads.append(a.grad)
    assert torch.equal(grads[0].isnan(), grads[1].isnan()) and int(grads[0].isnan().sum()) == 32
    off_max = (x.abs() != x.reshape(-1, 32).abs().amax(1).repeat_interleave(32).reshape(x.shape)) & ~grads[1].isnan()
    assert torch.equal(grads[0][off_max], grads[1][off_max])


def test_a_second_derivative_is_refused(kernels_on):
    x, clip = inputs(4, 64, kernels_on)
    a = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fq.fake_quant(a, clip, 4).square().sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked with @once_differentiable"):
        g.sum().backward()


def test_equal_maxima_share_the_gradient_as_amax_does(kernels_on):
    """A group whose largest magnitude appears at 7 places (with both signs) and a clip of 1: each maximum receives
    1/7 of the gradient reaching ``absmax``, signed; exact here (dyadic values, one term per sum)."""
    x = torch.zeros(1, 32, device=kernels_on)
    x[0, ::5] = torch.tensor([7.0, -7.0, 7.0, -7.0, 7.0, 7.0, -7.0], device=kernels_on)
    x[0, 1] = 3.0
    clip = torch.tensor(1.0, device=kernels_on, requires_grad=True)
    gy = torch.zeros_like(x)
    gy[0, 1] = 1.0  # only the value 3 (code 3, scale 1): d/ds = c - x / s = 0, so pick one that rounds
    x[0, 1] = 3.25  # code 3, v = 3.25: d/ds = 3 - 3.25 = -0.25
    a = x.clone().requires_grad_(True)
    fq.fake_quant(a, clip, 4).backward(gy)
    b = x.clone().requires_grad_(True)
    c = clip.detach().clone().requires_grad_(True)
    torch_fake_quant(b, 4, c).backward(gy)
    assert torch.equal(a.grad, b.grad) and torch.equal(clip.grad, c.grad)
    maxima = a.grad[0, ::5]
    assert torch.equal(maxima.abs(), maxima.abs()[:1].expand(7)) and float(maxima[0]) != 0.0


def test_a_student_step_takes_the_kernels_and_matches(kernels_on, monkeypatch):
    """The tiny Ouro's student, one forward + backward through the quantized groups: the kernels run (counted), the
    loss is the torch ops' loss bit for bit (the forward is), and every trained parameter's gradient is the torch
    ops' up to the group sums' order carried through the network: within 3e-5 of the largest gradient of its
    tensor (2.7e-6 measured; up to 7.9e-6 over other seeds, the same with 1 or 2 threads)."""
    from loopq.models.ouro import OuroConfig, OuroLM
    from loopq.quant import QuantConfig, prepare

    cfg = OuroConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)  # fmt: skip
    student = prepare(OuroLM.from_config(cfg, seed=0), QuantConfig()).to(kernels_on)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0)).to(kernels_on)
    launches = []
    real = fq.forward
    monkeypatch.setattr(fq, "forward", lambda *a: launches.append(1) or real(*a))

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        student.zero_grad()
        loss = student(ids).logits.float().square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    loss, grads = step()
    assert launches and grads
    monkeypatch.setattr(fq, "DEVICES", set())
    want_loss, want = step()
    assert torch.equal(loss, want_loss) and grads.keys() == want.keys()
    for name, g in grads.items():
        # measured 2.7e-6 of the largest gradient here, up to 7.9e-6 over seeds 0-2 with 1 or 2 threads: ~4x margin
        assert float((g - want[name]).abs().max()) <= 3e-5 * float(want[name].abs().max()), name
