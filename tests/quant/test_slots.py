"""The one loop-slot policy (loopq.quant.slots) and its readers agree on loop extrapolation."""

import pytest
import torch

from loopq.models import load_looplm
from loopq.paths import ASSETS
from loopq.quant import QuantConfig, prepare, quant_groups
from loopq.quant.slots import loop_slot


def test_loop_slot_by_hand():
    assert [loop_slot(t, 4) for t in range(7)] == [0, 1, 2, 3, 3, 3, 3]  # beyond T: the last loop's entry
    assert loop_slot(5, 1) == 0 and loop_slot(None, 4) == 0  # shared parameter; a call without a loop index
    with pytest.raises(ValueError, match="at least one entry"):
        loop_slot(0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        loop_slot(-1, 4)


def test_group_and_adapter_read_the_same_slot_beyond_the_calibrated_loops():
    student = prepare(load_looplm(ASSETS / "tiny-ouro"), QuantConfig())
    group = next(g for g in quant_groups(student).values() if g.looped)
    assert [group.slot(t) for t in range(6)] == [0, 1, 2, 3, 3, 3]
    clips = [float(group.act_clip_ratio(group.slot(t))) for t in (3, 5)]
    assert clips[0] == clips[1]
    h = torch.randn(1, 3, student.state_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        last = student.transition.num_transitions - 1
        torch.testing.assert_close(student.transition(h, 7), student.transition(h, last))
