"""A user's loss_fn captured with the model (``runtime.loss_graphs``): when a captured graph may be reused."""

from __future__ import annotations

from autotp.runtime.loss_graphs import _scalars


def _z_loss(coefficient: float):
    def loss(output, target, eps=1e-6):
        return output.logsumexp(-1).square().mean() * coefficient + eps
    return loss


def test_the_numbers_a_loss_fn_closes_over_key_its_graph():
    """A coefficient on a schedule changes the key, so the loss is captured again rather than run stale."""
    assert _scalars(_z_loss(0.1)) == (0.1, 1e-6)
    assert _scalars(_z_loss(0.1)) != _scalars(_z_loss(0.2))
