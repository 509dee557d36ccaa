"""Kronecker transforms: factor sizes, exactness against a materialised Kronecker product (test only), inverses."""

import pytest
import torch

from loopq.quant.transforms import KroneckerTransform, kron_apply, kron_factors


@pytest.mark.parametrize(
    ("n", "factors"), [(64, (8, 8)), (128, (8, 16)), (160, (10, 16)), (5632, (64, 88)), (7, (1, 7))]
)
def test_factors_closest_to_sqrt(n, factors):
    assert kron_factors(n) == factors


def test_kron_apply_equals_the_kronecker_product():
    gen = torch.Generator().manual_seed(0)
    a, b, x = torch.randn(4, 4, generator=gen), torch.randn(6, 6, generator=gen), torch.randn(3, 24, generator=gen)
    torch.testing.assert_close(kron_apply(x, a, b), x @ torch.kron(a, b), atol=1e-5, rtol=1e-5)


def test_transform_preserves_the_linear_map():
    gen = torch.Generator().manual_seed(1)
    tr = KroneckerTransform(48)
    tr.randomize_(gen, scale=0.5)
    x, w = torch.randn(5, 48, generator=gen), torch.randn(7, 48, generator=gen)
    p1, p2, p1i, p2i = tr.matrices()
    torch.testing.assert_close(tr.activation(x, p1, p2) @ tr.weight(w, p1i, p2i).T, x @ w.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(p1 @ p1i, torch.eye(p1.shape[0]), atol=1e-5, rtol=0)


def test_identity_at_init_and_gradients_flow():
    tr = KroneckerTransform(32)
    x = torch.randn(2, 32)
    p1, p2, _, _ = tr.matrices()
    torch.testing.assert_close(tr.activation(x, p1, p2), x)
    tr.activation(x, *tr.matrices()[:2]).pow(2).sum().backward()
    assert all(p.grad is not None for p in tr.parameters())
