"""Data parallelism, the mesh's third axis: replicas that each train on their own slice of the global batch.

``fsdp`` hands each rank module to torch's FSDP2 (``fully_shard``) over the dp sub-mesh: parameters,
gradients and optimizer state are sharded over the replicas, parameters are all-gathered before each
forward and gradients reduce-scattered (averaged) after backward by FSDP's own hooks. The rewritten graphs
read their parameters with ``get_attr`` at call time, so FSDP's swap of the sharded parameters for the
unsharded ones in its pre-forward hook is what they read. ``replicate`` keeps every parameter whole on
every replica and averages gradients with a bucketed all-reduce after backward, as DDP does.

Either way the gradient is the mean over replicas of each replica's mean-reduced loss gradient: with
equal slices, exactly the gradient of the mean loss over the concatenated global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autotp.torch_private import at_backward_end
from autotp.errors import InputError
from autotp.mixed_precision import MixedPrecision
from autotp.options import DataParallelMode
from autotp.passes.parameter_data import data_writes
from autotp.runtime.mesh import Mesh
from autotp.runtime.precision import cast_left_out, fsdp_policy

BUCKET_BYTES = 25 * 2**20
"""Gradients are all-reduced in buckets of about this size (DDP's default): one collective per bucket,
not per parameter, without one buffer as large as the whole model."""


class ShardedUnit(nn.Module):
    """A rank module's train- and eval-mode graphs, sharded as one FSDP unit.

    The two graphs read one set of tensors; FSDP swaps a shared parameter on every module that holds it
    only within one unit, so they must be sharded together. ``forward`` runs the graph of the unit's mode.
    """

    def __init__(self, train_graph: fx.GraphModule, eval_graph: fx.GraphModule):
        super().__init__()
        self.train_graph, self.eval_graph = train_graph, eval_graph

    def forward(self, *inputs):
        """The train- or eval-mode graph's output, as the unit's mode says."""
        return (self.train_graph if self.training else self.eval_graph)(*inputs)


def _write_shards(unit: ShardedUnit, inputs) -> None:
    """The train graph's writes to its weights (a forward's ``p.data.clamp_``), made on the stored shards: the
    graph makes them on the all-gathered weights, which FSDP drops after the forward."""
    if unit.training:
        write_shards(unit.train_graph, local)


def write_shards(gm: fx.GraphModule, local) -> None:
    """Make ``gm``'s writes to its parameters on ``local(parameter)`` (this rank's stored piece of it) instead."""
    with torch.no_grad():
        for write, parameter in data_writes(gm):
            write.target(local(gm.get_parameter(parameter.target)).data, *write.args[1:], **write.kwargs)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor``: the local shard of an FSDP DTensor (sharing its storage), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dp_shard(whole: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``whole`` (a tensor whole over dp, this rank's over tp), laid out as ``like``'s; no
    communication."""
    return placed_like(whole, like).to_local()


def placed_like(whole: torch.Tensor, like: DTensor) -> DTensor:
    """``whole`` (whole over dp, this rank's piece over tp, as ``gathered`` gives it) as a DTensor laid out as
    ``like``: an FSDP shard over dp (FSDP cuts dim 0 as ``torch.chunk`` does), the tp piece as it is; no
    communication."""
    mesh = like.device_mesh
    axes = mesh.mesh_dim_names or ()
    if not tensor_parallel(axes):
        return distribute_tensor(whole, mesh, like.placements, src_data_rank=None)
    mine = whole
    if "dp" in axes:
        chunks = torch.chunk(whole, mesh.size(0))
        index = mesh.get_local_rank("dp")
        mine = chunks[index] if index < len(chunks) else whole.new_empty((0, *whole.shape[1:]))
    return DTensor.from_local(mine.contiguous(), mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def tensor_parallel(axes: tuple[str, ...]) -> bool:
    """Whether a DTensor on a mesh of these axes is tensor-parallel (its local piece is this rank's tp piece): the
    tp mesh ("tp", or the (dp, tp) mesh) or its 2-D view ("tp_chunks", "tp_holders": ``runtime.tp_params``)."""
    return any(axis == "tp" or axis.startswith("tp_") for axis in axes)


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole over the data-parallel replicas and this rank's over tensor parallelism (an FSDP shard is
    all-gathered: collective over dp; a tensor-parallel DTensor gives its local shard)."""
    if not isinstance(tensor, DTensor):
        return tensor
    axes = tensor.device_mesh.mesh_dim_names or ()
    if not tensor_parallel(axes):
        return tensor.detach().full_tensor()
    if "dp" not in axes:
        return tensor.detach().to_local()
    return _dp_whole(tensor.detach())


def _dp_whole(tensor: DTensor) -> torch.Tensor:
    """The tp-local tensor of an FSDP-sharded tensor-parallel DTensor (a (dp, tp) mesh): its dp shards, cut by FSDP
    along dim 0 as ``torch.chunk`` cuts (the last ones possibly short or empty), all-gathered over dp."""
    mesh = tensor.device_mesh
    mine = tensor.to_local()
    group = mesh.get_group("dp")
    lengths = [torch.zeros((), dtype=torch.int64, device=mine.device) for _ in range(mesh.size(0))]
    dist.all_gather(lengths, torch.tensor(mine.shape[0], dtype=torch.int64, device=mine.device), group=group)
    longest = max(int(n) for n in lengths)
    padded = mine.new_zeros((longest, *mine.shape[1:]))
    padded[:mine.shape[0]] = mine
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:int(n)] for p, n in zip(parts, lengths)])


class DataParallel:
    """How this rank's modules are replicated over ``mesh.dp`` replicas: FSDP2 sharding or gradient all-reduce."""

    def __init__(self, mesh: Mesh, mode: DataParallelMode, policy: MixedPrecision | None = None):
        self.mesh, self.mode, self.policy = mesh, mode, policy
        self.size, self.rank = mesh.dp, mesh.dp_rank
        self.bucketed: list = []
        """The gradient buckets that average over the replicas themselves (``take_buckets``)."""
        self.riding: set[int] = set()
        """Ids of the parameters a bucket averages over the replicas with its own (``take_buckets``)."""
        self.experts: set[int] = set()
        """Ids of parameters holding experts split among ep ranks above tp (``hold_experts``)."""
        self.whole: set[int] = set()
        """Ids of parameters FSDP leaves whole on every replica because an end-of-backward bucket sums their
        gradient shares over tp x dp (``wrap``; the adapters' whole matrices)."""
        self.expert_replicas = None

    def hold_experts(self, ids: set[int], replicas, count: int) -> None:
        """The parameters ``ids`` hold experts whose gradients are summed over ``replicas`` (a process group of
        ``count`` ranks) rather than over every data-parallel replica."""
        self.experts, self.expert_replicas = ids, replicas if count > 1 else None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are averaged over the replicas in: the policy's ``reduce_dtype``; under fsdp, if the
        policy names none, its ``param_dtype`` (FSDP2 reduces the gradients in the dtype they were computed in,
        the unsharded parameters' cast one); None: the gradients' own."""
        if self.policy is None:
            return None
        return self.policy.reduce or (self.policy.param if self.sharded else None)

    @property
    def sharded(self) -> bool:
        """Whether parameters, gradients and optimizer state are sharded over the replicas (fsdp)."""
        return self.mode is DataParallelMode.FSDP

    def wrap(self, train_graph: fx.GraphModule, eval_graph: fx.GraphModule) -> ShardedUnit | None:
        """The FSDP unit running both graphs (fsdp); None under ``replicate``, where the graphs run as they are."""
        if not self.sharded:
            return None
        from torch.distributed.fsdp import fully_shard

        unit = ShardedUnit(train_graph, eval_graph)
        # Explicitly True: FSDP's default keeps a root's parameters whole after forward until the backward,
        # so after a forward with no backward (an evaluation, a forward before the optimizer is made)
        # ``parameters()`` would hand out the whole tensors instead of the shards.
        # ep above tp: a rank's experts are not its dp replicas' (they hold other experts), so FSDP leaves them
        # whole on the rank; their gradients are summed over the ranks holding the same experts (average_gradients)
        experts = {p for p in unit.parameters() if id(p) in self.experts}
        # the adapters' whole matrices (r x d, small) stay whole too: their tp shares and dp mean are then one
        # all-reduce in the gradient bucket, as under replicate, instead of one tp all-reduce per adapted layer
        whole = kept_whole([train_graph, eval_graph])
        self.whole |= {id(p) for p in whole}
        # FSDP casts only what it shards: the whole matrices are cast here as it would cast them (the experts need
        # not be: a mixed-precision policy at ep above tp under fsdp is refused, ``expert_groups.check_ep_layout``)
        cast_left_out([train_graph, eval_graph], {id(p) for p in whole}, self.policy)
        fully_shard(unit, mesh=self.mesh.dp_mesh, reshard_after_forward=True, mp_policy=fsdp_policy(self.policy),
                    ignored_params=(experts | whole) or None)
        if data_writes(train_graph):  # before FSDP's own pre-forward hook gathers the shards
            unit.register_forward_pre_hook(_write_shards, prepend=True)
        return unit

    def average_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Average the gradients of ``params`` over the replicas (``replicate``; under fsdp FSDP's hooks already
        did, but for the experts it leaves whole at ep above tp). Parameters in an end-of-backward bucket were
        reduced over tp x dp there."""
        done = set().union(*(bucket.params for bucket in self.bucketed)) | self.riding
        held = [p for p in _unique(params) if p.grad is not None and id(p) not in done]
        # under fsdp, what it leaves whole for a bucket that could not span tp x dp (its group is then tp's alone)
        mine = [local(p.grad) for p in held if id(p) not in self.experts and (not self.sharded or id(p) in self.whole)]
        if mine or not self.sharded:
            self._average(mine, self.mesh.dp_group)
        # an expert's gradient: the rows each expert-parallel group routed to it, summed over the ranks holding it
        self._average([p.grad for p in held if id(p) in self.experts], self.expert_replicas)

    def _average(self, grads: list[torch.Tensor], group) -> None:
        """Sum ``grads`` over ``group`` (None: no other rank) and divide by the replicas (the mean loss's)."""
        reduce_dtype = self.reduce_dtype
        for bucket in _buckets(grads, BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            flat = flat.to(reduce_dtype) if reduce_dtype is not None else flat  # the policy's reduction dtype
            if group is not None:
                dist.all_reduce(flat, group=group)
            flat.div_(self.size)
            for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                grad.copy_(part.view_as(grad))

    def average_in_backward(self, params: Iterable[nn.Parameter]) -> None:
        """Under ``replicate``, average the gradients of ``params`` at the end of every backward that reaches them,
        as DDP does: the loop written for one process (``loss.backward()`` per micro-batch, then the optimizer) then
        trains the replicas as one. Each backward averages everything accumulated so far; what earlier backwards
        averaged is already equal on every replica, so the sum stays the mean of the micro-batches' gradients.
        Under fsdp only what FSDP leaves whole (experts at ep above tp, adapters' whole matrices) is averaged so, and
        the latter only where no bucket averaged them already."""
        params = [p for p in _unique(params)
                  if p.requires_grad and (not self.sharded or id(p) in self.experts or id(p) in self.whole)]
        if not params:
            return
        queued = False

        def run() -> None:
            nonlocal queued
            queued = False
            self.average_gradients(params)

        def hook(_) -> None:
            nonlocal queued
            if not queued:
                queued = True
                at_backward_end(run)

        for p in params:
            p.register_post_accumulate_grad_hook(hook)

    def take_buckets(self, buckets, pipelined: bool, modules: Iterable[nn.Module] = ()) -> None:
        """Set up the ranks' end-of-backward gradient buckets (``rewrite.grad_bucket``) for the replicas (``replicate``,
        or fsdp leaving the whole matrices out: ``wrap``): the bucket sums over the tp x dp ranks (the whole world;
        with pipelines, those of this rank's stages) in the replicas' reduction dtype and divides by dp, so the
        adapters' tp sum and dp average are one all-reduce, and the replicas' average leaves those parameters alone.
        ``pipelined``: the buckets are a pipeline's. Under ``replicate`` the other trainable parameters of
        ``modules`` (the adapters' split parts) ride in that all-reduce when small (``rewrite.bucket_riders``)."""
        from autotp.rewrite.comm import TorchComm

        world, block = dist.get_world_size(), self.mesh.tp * self.size
        if not buckets:
            return
        if self.sharded and not self.whole:  # FSDP reduces the unsharded parameters the graph reads: sum there
            for bucket in buckets:
                bucket.immediate = True
            return
        if world == block:
            comm = TorchComm(None)
        elif pipelined and world == block * self.mesh.pp:
            # this pipeline rank's tp x dp ranks: the mesh has no such group, and only they need to make it
            first = self.mesh.pp_rank * block
            comm = TorchComm(dist.new_group(list(range(first, first + block)), use_local_synchronization=True))
        else:
            return
        for bucket in buckets:
            bucket.comm, bucket.scale, bucket.reduce_dtype = comm, 1.0 / self.size, self.reduce_dtype
            self.bucketed.append(bucket)  # their parameters' gradients are averaged already
        if not self.sharded:  # under fsdp the split parts are FSDP's, reduce-scattered with the base
            self._ride(buckets[0], list(modules))

    def _ride(self, bucket, modules: list[nn.Module]) -> None:
        """Give ``bucket`` this rank's other trainable parameters to average in its all-reduce (the adapters'
        split parts, ``rewrite.bucket_riders``), unless a reduction dtype of the policy asks for another sum."""
        plain = self.policy is None or self.policy.reduce is None
        self.riding |= bucket.take_riders(modules, self.experts, self.mesh.tp_rank, self.mesh.tp, self.size,
                                          BUCKET_BYTES if plain else 0)

    def counts(self, param: nn.Parameter | None = None) -> bool:
        """Whether this replica's gradient of ``param`` enters a norm over all ranks: each shard under fsdp; under
        ``replicate`` (and for what FSDP leaves whole for a bucket) every replica holds the same whole gradient, so
        only the first counts it."""
        return (self.sharded and id(param) not in self.whole) or self.rank == 0


def kept_whole(graphs: list[fx.GraphModule]) -> set[nn.Parameter]:
    """The trainable parameters ``graphs`` read through a ``GradSum`` (an adapter's whole matrix), which FSDP leaves
    whole so that the gradient bucket reduces them (cast as FSDP would cast them: ``cast_left_out``)."""
    from autotp.rewrite.grad_bucket import bucketed_ids

    ids = bucketed_ids(graphs)
    return {p for gm in graphs for p in gm.parameters() if id(p) in ids and p.requires_grad}


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _buckets(grads: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of gradients of one dtype and device, each about ``limit`` bytes at most."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > limit or g.dtype != bucket[0].dtype or g.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


@contextlib.contextmanager
def unsharded(units: Iterable[ShardedUnit]):
    """The units' parameters whole for the block (a no-grad forward that calls their graphs directly)."""
    units = list(units)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def check_unshared(stage_graphs: dict[int, fx.GraphModule]) -> None:
    """FSDP shards each pipeline stage as its own unit: two stages on one rank reading one parameter (a
    weight shared by blocks the pipeline cut apart) cannot both swap it, so refuse before sharding."""
    owner: dict[int, int] = {}
    for index, gm in stage_graphs.items():
        for target, param in gm.named_parameters():
            first = owner.setdefault(id(param), index)
            if first != index:
                raise InputError(f"parameter {target} is read by pipeline stages {first} and {index}, which this rank "
                                 "both holds; dp_mode='fsdp' shards each stage as its own unit and cannot share a "
                                 "parameter between two units: use dp_mode='replicate', or cuts= that keep its readers "
                                 "in one stage")
