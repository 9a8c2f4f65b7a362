"""A user's loss_fn captured with the model (``runtime.loss``): when a captured graph may be reused."""

from __future__ import annotations

from autotp.runtime.loss import _scalars


def _z_loss(coefficient: float):
    def loss(output, target, eps=1e-6):
        return output.logsumexp(-1).square().mean() * coefficient + eps
    return loss


def test_the_numbers_a_loss_fn_closes_over_key_its_graph():
    """A coefficient on a schedule changes the key, so the loss is captured again rather than run stale."""
    assert _scalars(_z_loss(0.1)) == (0.1, 1e-6)
    assert _scalars(_z_loss(0.1)) != _scalars(_z_loss(0.2))


def test_a_loss_fn_that_cannot_be_captured_gets_the_outputs_and_says_so():
    """Python control flow on a tensor value does not trace: the step falls back to the outputs as the model
    returns them, with a warning naming why, and computes the same loss."""
    import pytest
    import torch

    import autotp
    from tests import models

    def branchy(logits, target):
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        return loss * 2 if loss.item() > 100 else loss

    ref = models.build("gpt")
    x, y = models.tokens(2, 8, 3), models.tokens(2, 8, 4)
    pm = autotp.parallelize(ref, tp=1, example_inputs=x)
    with pytest.warns(UserWarning, match="loss_fn branchy runs on gathered outputs .* could not be captured"):
        loss = pm.step(x, target=y, loss_fn=branchy)
    torch.testing.assert_close(loss, branchy(ref(x), y).detach())


def test_a_weight_the_model_holds_itself_is_trained_through_the_loss_graph():
    """RawGPT keeps its tied embedding as its own parameter, not a child's: captured with a loss_fn, the graph
    reads it as the parallel module's parameter (it once read a constant copy, and the loss fell back to the
    gathered outputs), and training matches the model's."""
    import warnings

    import torch
    from torch.testing import assert_close

    import autotp
    from tests import models

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)

    torch.manual_seed(0)
    ref = models.build("raw_gpt")
    x, y = models.tokens(2, 8, 3), models.tokens(2, 8, 4)
    pm = autotp.parallelize(ref, tp=1, example_inputs=x)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fall-back to the gathered outputs
            loss = pm.step(x, target=y, loss_fn=loss_fn)
        want = loss_fn(ref(x), y)
        want.backward()
        assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_close(pm.full_state_dict()["embed"], ref.embed.detach(), rtol=1e-5, atol=1e-6)
