"""The teacher-target cache: a file is reused only for the targets it holds."""

import torch

from loopq.calib.targets import compute_targets, load_or_compute
from loopq.models import load_looplm
from loopq.paths import ASSETS


def test_a_bf16_teachers_cached_targets_are_not_reused_for_an_fp32_teacher(tmp_path):
    """The cache key held the teacher's content but not the dtype it computes in: an fp32 run sharing a cache
    directory with a bf16 run trained on the bf16 targets (a review measured 31 % of top-k indices differing)."""
    samples = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    fp32 = load_looplm(ASSETS / "tiny-ouro")
    bf16 = load_looplm(ASSETS / "tiny-ouro", dtype=torch.bfloat16)
    load_or_compute(bf16, "same-files", samples, 16, 4, str(tmp_path))
    got = load_or_compute(fp32, "same-files", samples, 16, 4, str(tmp_path))
    assert len(list(tmp_path.glob("teacher-targets-*.safetensors"))) == 2
    want = compute_targets(fp32, samples, 16, 4)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.states, want.states)
    again = load_or_compute(fp32, "same-files", samples, 16, 4, str(tmp_path))  # read back, not recomputed
    assert torch.equal(again.values, got.values) and len(list(tmp_path.glob("teacher-targets-*"))) == 2


def test_targets_are_written_into_one_allocation_and_equal_the_chunkwise_computation():
    """compute_targets fills tensors allocated once for all samples (concatenating per-chunk lists held the targets
    twice): the result is what each chunk's own forward gives, whatever the chunking."""
    from loopq.calib.targets import teacher_topk

    samples = torch.randint(0, 2048, (5, 16), generator=torch.Generator().manual_seed(1))
    teacher = load_looplm(ASSETS / "tiny-ouro")
    got = compute_targets(teacher, samples, 8, 4, batch_size=2)  # chunks of 2, 2, 1
    assert got.values.shape == (5, 16, 8) and got.states.shape[:3] == (5, 4, 16)
    values, indices, states = [], [], []
    for chunk in samples.split(2):  # the same chunks, concatenated (the former implementation)
        with torch.no_grad():
            out = teacher(chunk, num_loops=4, return_trajectory=True)
        v, i = teacher_topk(out.logits, 8)
        values.append(v.half()), indices.append(i), states.append(torch.stack(out.loop_states, 1).half())
    assert torch.equal(got.values, torch.cat(values)) and torch.equal(got.states, torch.cat(states))
    assert got.indices.dtype == torch.int16 and torch.equal(got.indices.long(), torch.cat(indices).long())
