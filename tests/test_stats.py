"""Seed statistics and the log-gap recovery against hand computations."""

import math

import pytest

from loopq.stats import Summary, log_gap_recovery, separated, summarize


def test_summarize_by_hand():
    s = summarize([1.0, 2.0, 3.0])
    assert (s.mean, s.std, s.n) == (2.0, 1.0, 3)  # sample std: sqrt((1 + 0 + 1) / 2)
    assert str(s) == "2.00 ± 1.00" and str(summarize([5.0])) == "5.00"
    with pytest.raises(ValueError, match="no values"):
        summarize([])


def test_log_gap_recovery_by_hand():
    assert log_gap_recovery(100.0, 200.0, 200.0) == 0.0
    assert log_gap_recovery(100.0, 200.0, 100.0) == 1.0
    assert log_gap_recovery(100.0, 400.0, 200.0) == pytest.approx(0.5)  # half the log gap
    assert math.isnan(log_gap_recovery(100.0, 100.0, 100.0))


def test_separated_uses_the_single_run_spread():
    a, b = Summary(10.0, 0.3, 3), Summary(11.0, 0.4, 3)  # spread 0.5: |diff| 1.0 is not > 2 * 0.5
    assert not separated(a, b)
    assert separated(a, Summary(11.1, 0.4, 3))
    assert not separated(Summary(1.0, 0.0, 1), Summary(5.0, 0.0, 1))  # no spread measured: no claim
