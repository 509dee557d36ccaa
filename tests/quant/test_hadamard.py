"""Hadamard matrices (Sylvester, Paley I and their products), QuaRot's randomized rotation, and the fallback."""

import math

import pytest
import torch

from loopq.quant.hadamard import hadamard, paley, random_orthogonal, randomized_hadamard, sylvester

BUILT = [1, 2, 4, 8, 12, 16, 20, 24, 40, 44, 48, 64, 88, 128, 384]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", BUILT)
def test_hadamard_rows_are_orthogonal_with_unit_entries(n):
    h = hadamard(n)
    assert h is not None and h.shape == (n, n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_small_cases_by_hand():
    assert torch.equal(sylvester(2), torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    # q = 3: residues {1}; chi = [0, 1, -1]; Q_ij = chi(j - i)
    want = torch.tensor(
        [[1, 1, 1, 1], [-1, 1, 1, -1], [-1, -1, 1, 1], [-1, 1, -1, 1]],
        dtype=torch.float64,
    )
    assert torch.equal(paley(3), want)


@pytest.mark.parametrize("q", [5, 9, 13])
def test_paley_needs_a_prime_3_mod_4(q):
    with pytest.raises(ValueError, match="prime q = 3"):
        paley(q)


@pytest.mark.parametrize("n", [4, 12, 20, 24, 128])
def test_randomized_hadamard_is_orthogonal_with_random_signs(n):
    r = randomized_hadamard(n, gen(0))
    torch.testing.assert_close(r @ r.T, torch.eye(n), atol=1e-6, rtol=0)
    torch.testing.assert_close(r.abs(), torch.full((n, n), 1 / math.sqrt(n)))
    signs = torch.sign(r) * torch.sign(hadamard(n)).float()  # diag(s) H: every row is H's row times one sign
    assert torch.equal(signs, signs[:, :1].expand(n, n))
    assert not torch.equal(randomized_hadamard(n, gen(1)), r)


@pytest.mark.parametrize("n", [10, 28, 36])
def test_orders_without_a_construction_fall_back_to_a_random_orthogonal_matrix(n):
    assert hadamard(n) is None
    r = randomized_hadamard(n, gen(0))
    torch.testing.assert_close(r @ r.T, torch.eye(n), atol=1e-6, rtol=0)
    assert torch.equal(r, random_orthogonal(n, gen(0)))  # deterministic in the seed
    assert r.abs().max() < 1  # not a permutation: it mixes channels


def test_kronecker_of_two_randomized_hadamards_is_a_randomized_hadamard():
    """What a group transform P1 (x) P2 of width 24 * 16 becomes: orthogonal, all entries +-1/sqrt(n)."""
    r = torch.kron(randomized_hadamard(24, gen(0)), randomized_hadamard(16, gen(1)))
    n = 24 * 16
    torch.testing.assert_close(r @ r.T, torch.eye(n), atol=1e-5, rtol=0)
    torch.testing.assert_close(r.abs(), torch.full((n, n), 1 / math.sqrt(n)))
