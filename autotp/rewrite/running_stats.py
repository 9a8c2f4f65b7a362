"""A training batch norm of channels split across ranks, its running statistics kept whole on every rank.

Each rank normalises its own channels, whose batch statistics are their own (exact). The running mean and
variance are buffers every rank keeps whole (checkpoints and evaluation read them as the unsharded model has
them): each rank updates its channels' part, then the parts are all-gathered into the whole buffers, so every
rank's buffers equal the unsharded model's after every step. They carry no gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from autotp.passes.placement import assemble, chunk_lengths
from autotp.rewrite.comm import Communicator, all_gather_chunks
from autotp.rewrite.shards import local_value


class ChannelBatchNorm(nn.Module):
    """``aten.batch_norm`` on this rank's channels (``segments`` of dim 1), the whole running statistics updated
    from every rank's part."""

    def __init__(self, comm: Communicator, segments: tuple[int, ...]):
        super().__init__()
        self.comm, self.segments = comm, segments

    def forward(self, x, weight, bias, mean, var, training, momentum, eps, cudnn_enabled=True):
        own = [None if t is None else local_value(t, 0, self.segments, self.comm.rank, self.comm.size)
               for t in (mean, var)]
        out = torch.ops.aten.batch_norm.default(x, weight, bias, *own, training, momentum, eps, cudnn_enabled)
        kept = [(whole, part) for whole, part in zip((mean, var), own) if whole is not None]
        if training and kept:
            with torch.no_grad():  # one all-gather for both statistics
                mine = torch.stack([part for _, part in kept])  # a vocabulary's channels may be cut unevenly
                parts = all_gather_chunks(self.comm, mine, 1, chunk_lengths(self.segments, self.comm.size))
                updated = assemble(parts, 1, self.segments)
                for (whole, _), new in zip(kept, updated):
                    whole.copy_(new)
        return out
