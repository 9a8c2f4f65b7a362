"""Whole parameters whose gradient each rank computes only a share of, summed in one all-reduce per backward.

A low-rank adapter beside a split base layer keeps one of its matrices whole (``A`` on a column-split layer, ``B``
on a row-split one: r x d numbers), and each rank computes only its share of that matrix's gradient (it sees only
its part of the layer's outputs or inputs). Summing each share where it arrives (Megatron's ``f`` on the weight)
costs one small all-reduce per adapted layer. Megatron's ``finalize_model_grads`` instead all-reduces the gradients
of such replicated parameters together once the backward is done; so does this: ``GradSum`` (Operator
``GRAD_SUM``) reads the parameter unchanged forward and, backward, hands its share to the rank's ``GradBucket``
instead of to autograd. The bucket sums every share over the ranks in one all-reduce when the backward pass ends
(or, while ``held``, when a pipeline's schedule ends) and adds the sums to the parameters' ``.grad``. Each
``GradSum`` sits next to the layer that reads its parameter, so its share arrives with that layer's backward; an
``f`` over the same ranks whose all-reduce runs once every share is in (the first layer's input gradient, when an
adapted or trained embedding needs it; under a pipeline, that of a stage's first layer in the rank's last backward
of the step) carries them, and the bucket then makes no all-reduce of its own (``reduce_with_shares``).

Over data parallelism (``replicate``) the bucket's group is the tp x dp ranks (with pipelines, those of one pipeline
rank) and it divides by dp: the adapters' tp sum and dp average are one collective, and their split parts ride
in it, each tp rank's in its own slot (``bucket_riders``). Under ``fsdp`` the whole matrices are left out of FSDP's
sharding and summed so too (the split parts are FSDP's); under a policy casting FSDP's parameters the graphs read
them cast after the ``GradSum`` (as FSDP casts the others: ``runtime.precision.cast_left_out``) and the bucket sums in
the policy's reduction dtype (``reduce_dtype``), adding the sum to ``.grad`` in the parameter's dtype. A matrix left
in FSDP's sharding is read as FSDP's unsharded copy, whose gradient FSDP reduce-scatters itself: each share is then
summed where it arrives (``immediate``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autotp.rewrite.bucket_riders import local, local_sizes, pack, rider_params, slot_numel, unpack
from autotp.torch_private import at_backward_end, viewed_leaf

_BUCKETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Communicator -> its bucket: every ``GradSum`` of a rank's graphs over one group shares one."""


class GradBucket:
    """Gradient shares of whole parameters waiting to be summed over ``comm``'s ranks."""

    def __init__(self, comm):
        self.comm = comm
        self.scale = 1.0
        """Multiplies the sum (1/dp when ``comm`` spans the data-parallel replicas too: their mean)."""
        self.immediate = False
        """Sum each share where it arrives, as ``f`` on the weight would: under fsdp for a parameter in its sharding
        (the graph reads FSDP's unsharded copy, whose gradient FSDP reduce-scatters when its backward is done)."""
        self.reduce_dtype: torch.dtype | None = None
        """The dtype the shares are summed in (a mixed-precision policy's over replicas); None: their own."""
        self.held = False
        """Wait for ``flush`` (a pipeline's schedule runs one backward per microbatch)."""
        self.backwards = 0
        """While ``held``: how many times each ``GradSum`` hands over a share in the step (its microbatches); 0:
        unknown. Once every share of the step is in, an all-reduce of an activation's gradient may carry them."""
        self._arrivals: dict[str, int] = {}
        self._shares: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
        self._queued = False
        self.params: set[int] = set()
        """The ids of the parameters whose shares it has taken (the replicas' average leaves them to it)."""
        self.expected: set[str] = set()
        """The keys of every ``GradSum`` over this group (set by the rewrite): once all have their shares, the next
        all-reduce of an activation's gradient over the group carries them (``reduce_with_shares``)."""
        self.riders: list[nn.Parameter] = []
        """Split parameters averaged over the replicas in the same all-reduce, each tp rank's in its own slot of a
        zero-padded region (``rewrite.bucket_riders``; set by the data parallelism, empty otherwise)."""
        self.slot = (0, 1, 0)
        """(this rank's slot, number of slots (tp), elements per slot) of the riders' region."""

    def add(self, key: str, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
        """Take ``param``'s gradient share (``key``: its name, the same on every rank); returns the gradient autograd
        should pass on to it now (the sum, when ``immediate``), else None."""
        if self.immediate:
            return self.comm.all_reduce(grad)
        held = self._shares.get(key)
        self._shares[key] = (param, grad if held is None else held[1] + grad)
        self._arrivals[key] = self._arrivals.get(key, 0) + 1
        self.params.add(id(param))
        if not self.held and not self._queued:
            self._queued = True
            at_backward_end(self.flush)
        return None

    def take_riders(self, modules: list[nn.Module], skip: set[int], tp_rank: int, tp: int, dp: int,
                    limit: int) -> set[int]:
        """Average the other trainable parameters of ``modules`` (not in ``skip``: experts) over the replicas in
        this bucket's all-reduce, this rank's in slot ``tp_rank`` of ``tp``, when they are of one dtype and the
        padded region is at most ``limit`` bytes; returns their ids (none when not). A collective over the
        bucket's ranks (the slot size is agreed once)."""
        riders = rider_params(modules, bucketed_ids(modules) | skip)
        slot = slot_numel(self.comm, sum(local_sizes(riders)), tp_rank, tp, dp)
        if not slot or len({p.dtype for p in riders}) != 1 or tp * slot * riders[0].element_size() > limit:
            return set()
        self.riders, self.slot = riders, (tp_rank, tp, slot)
        return {id(p) for p in riders}

    def ready(self, comm, dtype: torch.dtype) -> bool:
        """Whether an all-reduce over ``comm`` of a ``dtype`` gradient may carry the shares now: every expected
        share is in (while ``held``: every share of the step, the last backward's too), all of ``dtype``, summed over
        that same group as they are (``reduce_with_shares``)."""
        return (self._all_in() and not self.immediate and self.reduce_dtype in (None, dtype) and self.comm is comm
                and self.scale == 1.0 and not self.riders and bool(self.expected)
                and all(g.dtype == dtype for _, g in self._shares.values()))

    def _all_in(self) -> bool:
        """Whether every share this backward (while ``held``: this step) will hand over has arrived."""
        if not self.held:
            return self._queued and self.expected <= self._shares.keys()
        # a key handing over more or fewer shares than the step's backwards (read twice, or in one graph only) never
        # matches: the held bucket then sums on its own at the step's end
        return self.backwards > 0 and all(self._arrivals.get(key, 0) == self.backwards for key in self.expected)

    def flush(self) -> None:
        """Sum the shares taken so far over the ranks, in one all-reduce per dtype, and add them to ``.grad``."""
        self._queued = False
        self._arrivals = {}
        shares, self._shares = self._shares, {}
        by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for key in sorted(shares):  # the same order on every rank, whatever order the backward reached them in
            param, grad = shares[key]
            by_dtype.setdefault(grad.dtype, []).append((param, grad))
        riding = self.riders[0].dtype if self.riders else None
        if riding is not None:
            by_dtype.setdefault(riding, [])
        for dtype, entries in by_dtype.items():
            flat = torch.cat([g.reshape(-1) for _, g in entries])
            if dtype == riding:  # the split parts' dp average joins this all-reduce (``rewrite.bucket_riders``)
                grads = [None if p.grad is None else local(p.grad) for p in self.riders]
                flat = torch.cat([flat, pack(self.riders, grads, self.slot[2], self.slot[0], self.slot[1], dtype)])
            if self.reduce_dtype is not None:  # the policy's reduction dtype; ``_accumulate`` casts back
                flat = flat.to(self.reduce_dtype)
            flat = self.comm.all_reduce(flat)
            if self.scale != 1.0:
                flat = flat * self.scale
            shared = sum(g.numel() for _, g in entries)
            for (param, grad), part in zip(entries, flat[:shared].split([g.numel() for _, g in entries])):
                _accumulate(param, part.view_as(grad))
            if dtype == riding:
                unpack(flat[shared:], self.riders, grads, self.slot[2], self.slot[0])


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` (this rank's local tensor) to ``param.grad`` as autograd's accumulation would: a DTensor of the
    parameter's placement for a DTensor parameter (``runtime.tp_params``). A module's full backward hook may have
    left plain zeros there (it materialises the gradient ``GradSum`` does not pass on): those are taken as local."""
    with torch.no_grad():
        grad = grad.to(param.dtype)
        held = param.grad
        if held is not None:
            grad = grad + (held.to_local() if isinstance(held, DTensor) else held)
        if isinstance(param, DTensor):
            grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        if held is None or type(held) is not type(grad):
            param.grad = grad if held is not None else grad.clone()
        else:
            held.copy_(grad)


def bucket_of(comm) -> GradBucket:
    """The bucket of ``comm``'s group (made on first use)."""
    bucket = _BUCKETS.get(comm)
    if bucket is None:
        bucket = _BUCKETS[comm] = GradBucket(comm)
    return bucket


class _GradSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param, bucket, key, stored):
        # ``stored``: the tensor the module was given, in a list (as an argument autograd would hand ``forward``
        # another object for it); a view of the parameter when a module hook wrapped it (``viewed_leaf``)
        ctx.stored, ctx.bucket, ctx.key = stored, bucket, key
        if isinstance(param, DTensor):  # the graph computes on local tensors
            return param.to_local().detach()  # not a view: autograd would route its gradient to the DTensor's inside
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        given = ctx.stored[0]
        param = viewed_leaf(given)
        if not (param.is_leaf and param.requires_grad):  # not a parameter as stored (a cast): sum the share here
            return ctx.bucket.comm.all_reduce(grad), None, None, None
        now = ctx.bucket.add(ctx.key, param, grad)
        if now is not None and isinstance(given, DTensor):  # autograd hands a DTensor parameter a DTensor gradient
            now = DTensor.from_local(now, given.device_mesh, given.placements, run_check=False, shape=given.shape,
                                     stride=given.stride())
        # zeros rather than None: a module's backward hook between the parameter and here would make its own plain
        # zeros of a DTensor parameter's gradient; these are of the parameter's type (and start its ``.grad``)
        return (now if now is not None else torch.zeros_like(given)), None, None, None


class GradSum(nn.Module):
    """Read a whole parameter unchanged (its local tensor, for a DTensor parameter); backward, its gradient share
    goes to the rank's ``GradBucket``."""

    def __init__(self, comm, key: str = ""):
        super().__init__()
        self.comm, self.key = comm, key
        """``key``: the parameter's node name in the captured graph, the same on every rank (set by the rewrite)."""

    @property
    def bucket(self) -> GradBucket:
        """The bucket this module's shares go to."""
        return bucket_of(self.comm)

    def forward(self, param):
        return _GradSum.apply(param, self.bucket, self.key, [param])


def reduce_with_shares(comm, grad: torch.Tensor) -> torch.Tensor:
    """``comm.all_reduce(grad)`` (an ``f``'s backward), carrying the bucket's shares in the same all-reduce when
    every share the group's graphs read has arrived: the first layer's input all-reduce then sums them too, so the
    bucket adds no collective of its own. Under a pipeline (the bucket ``held``) only once every share of the step
    is in: in the rank's last backward of the step, at its first layer's input all-reduce. Not over replicas (the
    bucket's group is then another), nor with shares of another dtype, nor while compiling. The ranks of a stage
    run one graph and one schedule, so they decide alike."""
    bucket = _BUCKETS.get(comm)
    # a compiled backward is traced once: the bucket's state then is no guide to a later step's
    if bucket is None or torch.compiler.is_compiling() or not bucket.ready(comm, grad.dtype):
        return comm.all_reduce(grad)
    shares, bucket._shares, bucket._arrivals = bucket._shares, {}, {}
    entries = [shares[key] for key in sorted(shares)]  # one order on every rank
    flat = comm.all_reduce(torch.cat([grad.reshape(-1), *(g.reshape(-1) for _, g in entries)]))
    parts = flat[grad.numel():].split([g.numel() for _, g in entries])
    for (param, share), part in zip(entries, parts):
        _accumulate(param, part.view_as(share))
    return flat[:grad.numel()].view_as(grad)


def bucketed_ids(modules: Iterable[nn.Module]) -> set[int]:
    """Ids of the parameters ``modules``' graphs read through a ``GradSum`` (their gradient shares go to a bucket)."""
    out: set[int] = set()
    for gm in modules:
        graph = getattr(gm, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "call_module" and isinstance(gm.get_submodule(node.target), GradSum):
                out.add(id(gm.get_parameter(node.args[0].target)))
    return out


def grad_buckets(modules: Iterable[nn.Module]) -> list[GradBucket]:
    """The buckets the ``GradSum`` modules in ``modules`` (and their children) use, each once."""
    found: dict[int, GradBucket] = {}
    for module in modules:
        for child in module.modules():
            if isinstance(child, GradSum):
                found.setdefault(id(child.bucket), child.bucket)
    return list(found.values())


def expect_only(buckets: list[GradBucket], modules: Iterable[nn.Module]) -> None:
    """The buckets expect the shares of the ``GradSum`` modules in ``modules`` alone: a pipeline rank's stages (the
    rewrite makes every stage's graphs over one communicator, so a bucket's ``expected`` names the other stages'
    keys too, whose shares never arrive on this rank)."""
    keys = {child.key for module in modules for child in module.modules() if isinstance(child, GradSum)}
    for bucket in buckets:
        bucket.expected &= keys


@contextlib.contextmanager
def held(buckets: list[GradBucket], backwards: int = 0):
    """The buckets wait through the block (a pipeline schedule's many backwards: ``backwards`` per stage, its
    microbatches; 0 when unknown) and sum their shares once at its end, unless the step's last all-reduce of an
    activation's gradient over their group carried them (``reduce_with_shares``)."""
    for bucket in buckets:
        bucket.held, bucket.backwards, bucket._arrivals = True, backwards, {}
    try:
        yield
    finally:
        for bucket in buckets:
            bucket.held, bucket.backwards = False, 0
    for bucket in buckets:
        bucket.flush()
