"""The decode plan of a packed group (:mod:`loopq.kernels.decode_plan`): repeated decode calls skip the checked
call, launch what it launches, give its bits, and follow every change of the group's buffers.

The group has what the hot path reads: a transform whose ``n2`` is not a power of two (K = 96 = 8 x 12: the
quantizer's scratch row), loop-dependent weights and transforms (2 slots), per-loop clips, the diagonal, a bias and
three outputs.
"""

import copy

import pytest
import torch

from loopq.kernels import decode_kernel, ops
from loopq.kernels import quantize_kernel as qk
from loopq.kernels.decode_plan import plan_decode
from loopq.kernels.packing import tile_weight
from loopq.quant import packed
from loopq.quant.packed import PackedGroupSpec, PackedLinearGroup
from tests.kernels.cases import ON_CUDA, cuda_only

K, SPLITS = 96, (24, 8, 8)


def make_group(device: torch.device, seed: int = 0) -> PackedLinearGroup:
    spec = PackedGroupSpec(("a", "b", "c"), SPLITS, K, 4, True, 4, 2, 2, 4, True, True)
    group = PackedLinearGroup(spec, device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        group.weight.copy_(torch.randint(0, 256, group.weight.shape, generator=gen, dtype=torch.uint8))
        group.weight_scale.copy_(0.001 + 0.01 * torch.rand(group.weight_scale.shape, generator=gen))
        group.act_clip.copy_(0.5 + 0.5 * torch.rand(group.act_clip.shape, generator=gen))
        for t in (group.left, group.right, group.bias):
            t.copy_(torch.randn(t.shape, generator=gen))
        group.inv_d.copy_(0.5 + torch.rand(group.inv_d.shape, generator=gen))
    group.backend = "triton"
    return group


def count_checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token counts of the group's checked calls (``quantized_linear``)."""
    calls = []

    def checked(x, *args):
        calls.append(x.shape[0])
        return ops.quantized_linear(x, *args)

    monkeypatch.setattr(packed, "quantized_linear", checked)
    return calls


def tokens(m: int, device: torch.device, seed: int = 1) -> torch.Tensor:
    return (2 * torch.randn(m, 1, K, generator=torch.Generator().manual_seed(seed))).half().to(device)


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "tensor-core"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_repeated_decode_calls_take_the_plan_and_give_the_checked_bits(m, fast, device, monkeypatch):
    """Both quantizer paths (the tensor-core one with its decode split and scratch rows, forced in the interpreter)."""
    monkeypatch.setattr(qk, "uses_fast_path", lambda exact, device: exact is not True and fast)
    group, x = make_group(device), tokens(m, device)
    checked = count_checked(monkeypatch)
    loops = (0, 1, 3, 5)  # 5: past the calibrated slots
    with torch.inference_mode():
        first = [group(x, t) for t in loops]
        again = [group(x, t) for t in loops]
    assert checked == [m] * len(loops)  # the second round made no checked call
    for got, want in zip(again, first, strict=True):
        assert_same(got, want)
    assert not torch.equal(again[0][0], again[1][0])  # the loops read other slots


def _edits():
    """In-place writes (version), a buffer assignment and a storage swap (address), as load_state_dict, a manual
    edit or ``.to()`` would make them."""

    def assign_bias(g):
        g.bias = g.bias + 1

    def swap_scales(g):
        g.weight_scale.data = 2 * g.weight_scale

    def load(g):
        g.load_state_dict(make_group(g.act_clip.device, seed=5).state_dict())

    return {
        "act_clip": lambda g: g.act_clip.mul_(0.5),
        "left": lambda g: g.left.mul_(2.0),
        "inv_d": lambda g: g.inv_d[1].mul_(3.0),
        "weight": lambda g: g.weight.bitwise_xor_(0x11),
        "bias": assign_bias,
        "weight_scale": swap_scales,
        "load_state_dict": load,
    }


@pytest.mark.parametrize("edit", list(_edits()))
def test_a_plan_follows_every_change_of_the_buffers(edit, device):
    group, x = make_group(device), tokens(2, device)
    before = group(x, 1)
    assert_same(group(x, 1), before)  # planned
    with torch.no_grad():
        _edits()[edit](group)
    reference = PackedLinearGroup(group.spec, device=device)  # a fresh group: the checked call on the new values
    reference.load_state_dict(group.state_dict())
    reference.backend = "triton"
    want = reference(x, 1)
    assert not all(torch.equal(a, b) for a, b in zip(want, before, strict=True))
    assert_same(group(x, 1), want)


class _Recorder:
    """Kernel stubs recording each launch: kernel, grid, arguments (tensors as dtype and size), constexprs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.launches = []
        kernels = [(qk, "_quantize_kernel"), (qk, "_quantize_dot_kernel"), (decode_kernel, "_decode_kernel")]
        for module, name in [*kernels, (decode_kernel, "_decode_mma_kernel")]:  # 1..8 / 9..16 tokens
            monkeypatch.setattr(module, name, self.kernel(name))

    def kernel(self, name: str):
        launches = self.launches

        class Stub:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    described = [(a.dtype, a.numel()) if isinstance(a, torch.Tensor) else a for a in args]
                    launches.append((name, grid, described, kwargs))

                return launch

        return Stub()


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "dot"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16])
def test_the_plan_launches_what_the_checked_call_launches(m, fast, monkeypatch):
    """Stubbed kernels on CPU: the same two launches, grids, scalars and constexprs (both quantizer kernels)."""
    recorder = _Recorder(monkeypatch)
    monkeypatch.setattr(ops, "triton_interpreted", lambda: True)
    monkeypatch.setattr(qk, "uses_fast_path", lambda exact, device: exact is not True and fast)
    group, x = make_group(torch.device("cpu")), tokens(m, torch.device("cpu"))
    group(x, 2)
    checked = list(recorder.launches)
    group(x, 2)
    assert len(checked) == 2 and recorder.launches[2:] == checked
    assert checked[0][0] == ("_quantize_dot_kernel" if fast else "_quantize_kernel")
    assert checked[1][0] == ("_decode_mma_kernel" if m > 8 else "_decode_kernel")  # tensor cores from 9 tokens


def test_no_plan_for_prefill_the_torch_backend_or_factors_it_would_copy(device, monkeypatch):
    """A plan holds views: fp16 factors (converted at every checked call) get none."""
    group = make_group(device)
    checked = count_checked(monkeypatch)
    for _ in range(2):
        group(tokens(17, device), 0)
    group.backend = "torch"
    for _ in range(2):
        group(tokens(1, device), 0)
    group.backend, group.left = "triton", group.left.half()
    for _ in range(2):
        group(tokens(1, device), 0)
    assert checked == [17, 17, 1, 1, 1, 1] and group._decode_plans == {}


@pytest.mark.skipif(ON_CUDA, reason="the interpreter's bfloat16 refusal")
def test_a_new_input_dtype_is_checked_again(device):
    group = make_group(device)
    group(tokens(1, device), 0)
    with pytest.raises(ValueError, match=r"^bfloat16 is not supported by Triton's CPU interpreter"):
        group(tokens(1, device).bfloat16(), 0)


def test_copies_carry_no_plan_and_a_tensor_loop_index_gets_none(device):
    """A deep copy (or pickle) builds its own plans on its own buffers; ``t`` as a tensor would key by identity."""
    group, x = make_group(device), tokens(1, device)
    want = group(x, 1)
    copied = copy.deepcopy(group)
    assert len(group._decode_plans) == 1 and copied._decode_plans == {}
    assert_same(copied(x, 1), want)
    group._decode_plans = {}
    assert_same(group(x, torch.tensor(1)), want)
    assert group._decode_plans == {}


def test_scratch_is_never_shared_by_two_groups_of_one_shape_nor_by_two_threads(device):
    """The quantizer's codes and scales are consumed by the same call's GEMM: two groups of one shape (decoded one
    after the other) and two threads decoding with one group each write their own scratch."""
    import threading

    first, second, x = make_group(device), make_group(device), tokens(1, device)
    for group in (first, second):
        group(x, 0), group(x, 0)
    ((_, plan_a),), ((_, plan_b),) = first._decode_plans.values(), second._decode_plans.values()
    other = threading.Thread(target=lambda: first(x, 0))
    other.start(), other.join()
    assert len(plan_a.scratches) == 2 and len(plan_b.scratches) == 1
    scratch = [*plan_a.scratches.values(), *plan_b.scratches.values()]
    assert len({s.codes.data_ptr() for s in scratch}) == len({s.scales.data_ptr() for s in scratch}) == 3


def test_a_split_plan_repeats_the_checked_bits_and_leaves_the_counters_zero(device):
    """A K split (K = 2048 over 3 tiles: 8 programs per tile) in a plan: the shared arrival counters are zero again
    after every call, and every call gives the checked call's bits."""
    m, n, k = 2, 24, 2048
    gen = torch.Generator().manual_seed(3)
    wt, swt = tile_weight(torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
                          (0.01 * torch.rand(n, k // 32, generator=gen)).half())  # fmt: skip
    wt, swt, x = wt.to(device), swt.to(device), torch.randn(m, k, generator=gen).to(device)
    args = (x, wt, swt, n, None, None, None, 0.9, 4, None, torch.float32)
    want = ops.quantized_linear(*args, backend="triton")
    plan = plan_decode(*args, "triton", out_shape=(m, n))
    assert plan is not None and plan.gemm.split == 8
    counters = decode_kernel.arrival_counters(x.device, 3)
    for _ in range(3):
        assert torch.equal(plan(x), want)
        assert int(counters.abs().sum()) == 0


@cuda_only
def test_split_plans_in_cuda_graphs_replay_in_any_order():
    """Two graphs captured on the same capture stream (``torch.cuda.graph``'s default) with split launches, the
    second replayed first: each replay starts from its own zeroed counters, so both give the eager bits."""
    m, n, k = 2, 24, 2048
    gen = torch.Generator().manual_seed(4)
    wt, swt = tile_weight(torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
                          (0.01 * torch.rand(n, k // 32, generator=gen)).half())  # fmt: skip
    wt, swt, x = wt.cuda(), swt.cuda(), torch.randn(m, k, generator=gen).cuda()
    args = (x, wt, swt, n, None, None, None, 0.9, 4, None, torch.float32)
    want = ops.quantized_linear(*args, backend="triton")
    outs, graphs = [], []
    for _ in range(2):
        plan = plan_decode(*args, "triton", out_shape=(m, n))
        assert plan is not None and plan.gemm.split > 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(plan(x))
        graphs.append(graph)
    for graph, out in ((graphs[1], outs[1]), (graphs[0], outs[0]), (graphs[1], outs[1])):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
