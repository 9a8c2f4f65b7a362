"""Fake kernels for the fallback capture, where torch 2.13 has none for an op a model's loss uses.

``export_taking_example_branches`` traces with fake tensors and real values side by side (draft export). An op
without a fake kernel whose output size depends on its inputs' values stops that capture; CTC is one: its loss
(``aten._ctc_loss.Tensor``, every CTC head's loss with ``labels``) returns, beside the loss, the table of forward
variables sized by the longest target, a value of ``target_lengths``. The kernels here give that size as a fresh
symbol. They are registered only while such a capture runs, so the process is left as it was found.
"""

from __future__ import annotations

from autotp.torch_private import fake_kernels_registered as _registered
from autotp.torch_private import fresh_unbacked_size


def _ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """``aten._ctc_loss.Tensor``'s outputs, the loss per sequence and the forward variables (batch, input length,
    2 * longest target + 1): the longest target is read from values, so it is a new size symbol. The graph never
    reads it (only the op's own backward takes the table), so it is not bound to an output."""
    batch, frames = log_probs.shape[1], log_probs.shape[0]
    longest = fresh_unbacked_size()
    return log_probs.new_empty(batch), log_probs.new_empty(batch, frames, 2 * longest + 1)


FAKE_KERNELS = {"aten::_ctc_loss.Tensor": _ctc_loss_tensor}
"""Op name -> fake kernel, for the ops the fallback capture may meet without one."""


def fake_kernels_registered():
    """``FAKE_KERNELS`` registered while inside, removed after (the fence's ``fake_kernels_registered``)."""
    return _registered(FAKE_KERNELS)
