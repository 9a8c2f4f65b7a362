"""The vocabulary-parallel ops: Megatron's cross-entropy over class-split logits (the logits never gathered)
and the lookup in a vocabulary-split embedding table (a rank's rows, zeros elsewhere, summed by ``g``).

Both work on this rank's share of the classes or rows only; ``collectives.VocabParallelCrossEntropy`` is the
module the rewrite inserts for the loss, and ``runtime.outputs`` computes a step's default loss with the same
function.
"""

from __future__ import annotations

import torch

from autotp.errors import InputError
from autotp.passes.placement import chunk_span
from autotp.rewrite.comm import Communicator


class _CrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits split along the last dim (the classes), zero where ignored; with label
    smoothing ``eps``, ``(1 - eps)`` of it plus ``eps`` of the mean over every class of ``-log p`` (torch's)."""

    @staticmethod
    def forward(ctx, logits, target, comm, ignore_index, overwrite, smoothing=0.0, classes=None):
        local = logits.shape[-1]
        classes = local * comm.size if classes is None else classes
        offset = target - chunk_span(classes, comm.size, comm.rank)[0]
        valid = target != ignore_index
        mine = valid & (offset >= 0) & (offset < local)
        index = offset.clamp(0, local - 1).unsqueeze(-1)
        picked = logits.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
        stats = [logits.amax(-1)]
        top = stats[0]
        if smoothing:  # each rank's sum of its logits: with the others', the mean logit smoothing needs
            stats.append(logits.sum(-1))
        # Megatron overwrites its logits here; autotp only where the rewrite found that nothing else reads them.
        # Through a detached alias: the softmax saved below is then this Function's own tensor, not its input (a
        # view of another Function's output, which autograd would refuse to give back once overwritten).
        exp = (logits.detach().sub_(top.unsqueeze(-1)) if overwrite else logits - top.unsqueeze(-1)).exp_()
        # One all-gather of each rank's (max, sum of exponentials, target logit, and with smoothing its sum of
        # logits) gives every rank the whole log-sum-exp: Megatron's three all-reduces in one collective.
        gathered = torch.stack(comm.all_gather(torch.stack([*stats, exp.sum(-1), picked]))).unbind(1)
        tops, totals, picks = gathered[0], gathered[-2], gathered[-1]
        highest = tops.amax(0)
        lse = highest + (totals * (tops - highest).exp()).sum(0).log()
        softmax = exp.mul_((top - lse).exp().unsqueeze(-1))  # exp(x - top) * exp(top - lse), in place
        ctx.save_for_backward(softmax, index, mine, valid)
        ctx.spent, ctx.smoothing, ctx.classes = False, smoothing, classes
        loss = lse - picks.sum(0)
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing * (lse - gathered[1].sum(0) / ctx.classes)
        return loss.masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad):
        # d loss / d logits = softmax - (1 - eps) one_hot(target) - eps / classes, on this rank's classes: no
        # communication. Computed in the saved softmax's own memory, as Megatron does: a B×T×V/tp buffer less.
        if ctx.spent:
            raise InputError("the vocab-parallel cross-entropy's backward ran twice (backward(retain_graph=True) "
                             "again): it reuses its saved softmax for the gradient, as Megatron's does; run a "
                             "new forward for each backward, or pass loss_fn= (the logits are then gathered)")
        ctx.spent = True
        softmax, index, mine, valid = ctx.saved_tensors
        grad = grad.masked_fill(~valid, 0.0).unsqueeze(-1)  # no 0 * inf where ignored: torch's zeros
        out = softmax.mul_(grad)
        if ctx.smoothing:
            out.sub_(grad * (ctx.smoothing / ctx.classes))
        out.scatter_add_(-1, index, -(1 - ctx.smoothing) * mine.unsqueeze(-1).to(out.dtype) * grad)
        return out, None, None, None, None, None, None


MEAN, SUM = 1, 2
"""``aten.cross_entropy_loss``'s reduction codes (0: none)."""


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, comm: Communicator,
                                 reduction: int = MEAN, ignore_index: int = -100, overwrite: bool = False,
                                 label_smoothing: float = 0.0, classes: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(logits, target)`` of logits whose class dim (dim 1, or 0 when 1-d) is split over
    ``comm``'s ranks, in rank order, computed without gathering them: Megatron's vocab-parallel cross-entropy.
    ``classes``: how many in all, cut as ``chunk_span`` cuts them (None: evenly, as many on every rank). The mean
    is over the targets that are not ``ignore_index``, as torch's. ``overwrite``: the logits are the loss's to
    overwrite (nothing else reads them, no backward needs them), saving a buffer."""
    if logits.dim() >= 2:
        logits = logits.movedim(1, -1)
    losses = _CrossEntropy.apply(logits, target, comm, ignore_index, overwrite, float(label_smoothing), classes)
    if reduction == SUM:
        return losses.sum()
    if reduction == MEAN:
        return losses.sum() / (target != ignore_index).sum().to(losses.dtype)
    return losses



def masked_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, end: int,
                     padding_idx: int = -1) -> torch.Tensor:
    """Look up ``ids`` in this rank's rows [start, end) of a vocabulary-split table; zeros elsewhere.

    Summed over ranks (by ``g``), this equals the lookup in the full table. ``padding_idx`` is the full
    table's padding row (-1: none, as ``aten.embedding`` takes it): the rank holding it passes it on, so
    that row gets no gradient, as in the unsharded model.
    """
    outside = (ids < start) | (ids >= end)
    local_padding = padding_idx - start if start <= padding_idx < end else -1
    local = torch.ops.aten.embedding.default(weight, (ids - start).masked_fill(outside, 0), local_padding)
    return local.masked_fill(outside.unsqueeze(-1), 0.0)
