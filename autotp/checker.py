"""The one-process checker: simulate every rank of a plan and compare with the unsharded model.

``check`` builds each tensor-parallel rank's module exactly as ``parallelize`` does, but its collectives
talk to the other ranks through threads of this process (``ThreadComm``): no process group, no
torchrun. It runs one training step (dropout on, from one seed) on every rank and on a copy of the
model, and compares the output, the loss, every gradient and every parameter after an SGD step. When
something differs it replays the forward node by node and names the first operation whose value
differs: its module, op, sizes and error.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch
from torch import fx, nn
from autotp.torch_private.pytree import tree_leaves, tree_map

from autotp.capture import Captured, capture, example_inputs_of, model_kwargs
from autotp.errors import AutotpError, CaptureError, InputError, InternalError
from autotp.expert_check import above_tp, compare_experts, expert_names, expert_ranks
from autotp.mixed_precision import MixedPrecision
from autotp.options import Options, Recompute, capture_speedups
from autotp.passes.placement import Shard, full_tensor
from autotp.plan_choice import choose_plan, required_tp
from autotp.planning import Plan
from autotp.planning.machines import machine_for
from autotp.planning.context_plan import plan_context
from autotp.rewrite import rewrite
from autotp.rewrite.comm import ThreadComm, join_fully
from autotp.rewrite.context_graph import apply_context
from autotp.rewrite.graph_edit import STANDS_FOR
from autotp.rewrite.recompute import recompute_blocks
from autotp.rewrite.shards import local_part
from autotp.rewrite.streams import RankStream

SEED = 1234
LR = 0.1
RTOL, SCALE_TOL, ATOL = 1e-4, 1e-5, 1e-6
"""fp32 tolerances: an element may differ by RTOL of itself plus SCALE_TOL of the tensor's largest
element. Sums over ranks reorder additions, so a small element of a large sum (a bias gradient summed
over every position) carries rounding of the sum's size; a real error is of the values' own size."""


@dataclass
class Mismatch:
    """The first thing that differs from the unsharded model."""

    what: str
    """``output``, ``loss``, ``gradient``, ``parameter after a step``, ``buffer after a step`` or ``activation``."""
    where: str
    """The module (and parameter or op) at fault."""
    detail: str
    error: float

    def __str__(self) -> str:
        return f"{self.what} differs at {self.where}: {self.detail} (max abs error {self.error:.3g})"


@dataclass
class CheckReport:
    """What ``check`` found: exact (with the largest error seen), or the first mismatch."""

    tp: int
    plan: Plan | None = None
    """The plan that was checked."""
    read: frozenset[str] = frozenset()
    """The parameters the forward reads (a tower the inputs never reach is not among them)."""
    max_error: float = 0.0
    compared: int = 0
    """Tensors compared (outputs, gradients, parameters)."""
    mismatch: Mismatch | None = None
    located: Mismatch | None = None
    """The first forward operation whose value differs, when the forward is at fault."""
    rounding: Mismatch | None = None
    """A difference in the model's own dtype (float32, bf16) that the same check in a wider one shows to be
    rounding: sums reordered across ranks, amplified by the model (large attention scores), while the sharded
    computation is the same function."""
    widened: str | None = None
    """The dtype that check ran in: float64, or float32 for a bf16/fp16 model that cannot run in float64."""

    @property
    def exact(self) -> bool:
        """Whether every compared tensor agreed."""
        return self.mismatch is None

    def __str__(self) -> str:
        if self.exact:
            text = (f"exact: tp={self.tp}, {self.compared} tensors (output, loss, every gradient and parameter "
                    f"after an SGD step) agree with the unsharded model; largest error {self.max_error:.3g}")
            return text + (f" (in {self.widened}; in the model's own dtype {self.rounding}, which is rounding)"
                           if self.rounding else "")
        lines = [f"MISMATCH at tp={self.tp}: {self.mismatch}"]
        if self.located is not None:
            lines.append(f"  first differing operation: {self.located}")
        return "\n".join(lines)


def _loss(output, weights: list[torch.Tensor] | None = None):
    """A scalar that depends on every output element, with fixed random weights (so every gradient is used);
    a sum of squares, so it cannot cancel to a value smaller than its own rounding."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if weights is None:
        generator = torch.Generator().manual_seed(7)
        # drawn on the CPU (one stream whatever the device), then moved to each output's device
        weights = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in leaves]
    return sum((t * w).square().mean() for t, w in zip(leaves, weights)), weights


class _Rank(threading.Thread):
    """One simulated rank: forward, backward and an SGD step on its module."""

    def __init__(self, module: fx.GraphModule, comm: ThreadComm, inputs: tuple, weights, policy=None):
        super().__init__(daemon=True)
        self.module, self.comm, self.inputs, self.weights, self.policy = module, comm, inputs, weights, policy
        self.output = self.loss = self.error = None

    def run(self):
        try:
            with MixedPrecision.autocast_of(self.policy):  # autocast is per thread: each rank enters its own
                self.output = self.module(*self.inputs)
            self.loss, _ = _loss(self.output, self.weights)
            self.loss.backward()
        except BaseException as e:  # reported by the caller, once every thread has stopped
            self.error = e
            self.comm.abort()


def _simulate(modules: list[fx.GraphModule], comms: list[ThreadComm], inputs: tuple, weights,
              policy: MixedPrecision | None = None) -> list[_Rank]:
    ranks = [_Rank(m, c, inputs, weights, policy) for m, c in zip(modules, comms)]
    for r in ranks:
        r.start()
    join_fully(ranks)
    failed = [r for r in ranks if r.error is not None and not isinstance(r.error, AutotpError)]
    if failed:  # the unsharded model ran on these inputs, so a rank module that cannot is autotp's doing
        e = failed[0].error
        first = (str(e).strip().splitlines() or [""])[0]
        raise InternalError(f"simulated rank {failed[0].comm.rank} failed in its step: {type(e).__name__}: "
                            f"{first}") from e
    errors = [r.error for r in ranks if r.error is not None]
    if errors:
        raise errors[0]
    return ranks


class _Compare:
    """Accumulates comparisons; keeps the first mismatch."""

    def __init__(self, report: CheckReport):
        self.report = report

    def __call__(self, what: str, where: str, got: torch.Tensor, want: torch.Tensor) -> bool:
        got, want = got.detach().float(), want.detach().float()
        self.report.compared += 1
        if got.shape != want.shape:
            self._fail(what, where, f"shape {tuple(got.shape)} vs {tuple(want.shape)}", float("inf"))
            return False
        error = float((got - want).abs().max()) if got.numel() else 0.0
        self.report.max_error = max(self.report.max_error, error)
        if not close(got, want):
            self._fail(what, where, f"sizes {list(want.shape)}", error)
            return False
        return True

    def _fail(self, what, where, detail, error):
        if self.report.mismatch is None:
            self.report.mismatch = Mismatch(what, where, detail, error)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``got`` equals ``want`` up to fp32 rounding of sums (see ``RTOL``/``SCALE_TOL``)."""
    if got.shape != want.shape:
        return False
    if not got.numel():
        return True
    got, want = got.float(), want.float()
    scale = float(want.abs().max()) if torch.isfinite(want).all() else 0.0
    return torch.allclose(got, want, rtol=RTOL, atol=ATOL + SCALE_TOL * scale, equal_nan=True)


def build_ranks(captured: Captured, plan: Plan, seed: int = SEED,
                recompute: Recompute = Recompute.NONE) -> tuple[list[fx.GraphModule], list[ThreadComm]]:
    """Every tensor-parallel rank's module for ``plan``, its collectives joined through threads; with
    ``recompute``, blocks recompute their activations in backward as ``parallelize`` makes them."""
    if plan.options.cp > 1:
        return _context_ranks(captured, plan, recompute)
    if above_tp(plan):  # the experts spread over replicas too: every rank of dp x tp, each on the same example
        if recompute is not Recompute.NONE:
            raise InputError("the checker simulates ep above tp without recompute; check recompute at ep = tp")
        return expert_ranks(captured, plan, seed)
    comms = ThreadComm.group(plan.tp)
    modules = []
    for rank in range(plan.tp):
        stream = RankStream(seed)
        modules.append(rewrite(captured, plan, rank, comms[rank], stream))
        if recompute is Recompute.BLOCKS:
            recompute_blocks(modules[-1], captured.analysis, stream)
    return modules, comms


def _context_ranks(captured: Captured, plan: Plan,
                   recompute: Recompute) -> tuple[list[fx.GraphModule], list[ThreadComm]]:
    """Every context-parallel rank's module (each the whole model, computing its own tokens), joined by threads;
    with ``recompute``, its blocks recompute (and exchange again) in backward."""
    cp, tp = plan.options.cp, plan.tp
    layout = plan_context(captured, cp, plan.options.cp_exchange, plan.options.memory_budget)
    tp_comms = [ThreadComm.group(tp) if tp > 1 else [None] for _ in range(cp)]
    cp_comms = [ThreadComm.group(cp) for _ in range(tp)]
    modules, comms = [], []
    for c in range(cp):  # rank c * tp + t: tp innermost, as on the mesh
        for t in range(tp):
            # No random stream, as ``parallelize`` builds them: cp refuses random draws, and a stream would
            # rename the (probability 0) dropouts the layout names.
            gm = rewrite(captured, plan, t, tp_comms[c][t])
            apply_context(gm, layout, cp_comms[t][c], {n for n, p in gm.named_parameters() if p.requires_grad})
            if recompute is Recompute.BLOCKS:
                recompute_blocks(gm, captured.analysis, None)
            modules.append(gm)
            comms.append(cp_comms[t][c])
    return modules, comms


@dataclass
class Prepared:
    """A model captured for checking: ``check_prepared`` checks it at any tp without capturing it again (the
    capture is most of a small model's check, so a sweep over tps captures once)."""

    model: nn.Module
    example_inputs: object
    """As the caller gave them (the wider re-check casts these)."""
    example: object
    captured: Captured


def prepare(model: nn.Module, example_inputs=None, speedups: bool | None = None) -> Prepared:
    """Capture ``model`` on ``example_inputs`` (as for ``check``) once, for ``check_prepared`` at each tp
    (``speedups``: the ``capture_speedups`` option)."""
    example = example_inputs_of(model, example_inputs)
    return Prepared(model, example_inputs, example, capture(model, example, training=True, speedups=speedups))


def check(model: nn.Module, tp: int | None = None, example_inputs=None, *, plan: Plan | None = None,
          modules_hook=None, options: Options | None = None, **settings) -> CheckReport:
    """Simulate every rank of ``plan`` (default: autotp's plan at ``tp``) in this process and compare one
    training step with the unsharded model. ``example_inputs`` are as for ``autotp.plan`` (a tensor, a tuple,
    a dict of keyword tensors such as ``input_ids``, ``attention_mask`` and ``labels``, or left out for
    synthesised token ids); ``settings`` (``vocab``, ``sequence_parallel``, ...) are ``autotp.Options`` fields, as
    for ``autotp.plan`` (``vocab="split"`` checks the vocabulary split even where the cost model would keep it
    whole). ``modules_hook(modules, comms)`` may alter the rank modules before they run (the tests inject faults
    this way). The model is not changed."""
    _check_options(tp, plan, options, settings)  # refuse bad options before the capture's cost
    prepared = prepare(model, example_inputs, capture_speedups(options, settings))
    return check_prepared(prepared, tp, plan=plan, modules_hook=modules_hook, options=options, **settings)


def _check_options(tp: int | None, plan: Plan | None, options: Options | None, settings: dict) -> Options:
    if tp is None and plan is not None and isinstance(plan, Plan):
        tp = plan.tp
    chosen = Options.build(options, tp=required_tp(tp, options, settings.get("cp")), **settings)
    if chosen.mixed_precision is not None and chosen.mixed_precision.param_dtype is not None:
        raise InputError("the checker runs a policy's compute dtype (autocast); its param_dtype is checked by the "
                         "multi-process tests: leave param_dtype unset here")
    if chosen.pp != 1:
        raise InputError("the one-process checker simulates tensor parallelism (pp=1); pipeline stages are "
                         "checked by the multi-process tests, which run the same stage splitter")
    return chosen


def check_prepared(prepared: Prepared, tp: int | None = None, *, plan: Plan | None = None, modules_hook=None,
                   options: Options | None = None, **settings) -> CheckReport:
    """``check`` of a model ``prepare`` captured: the same check, at any tp, without capturing it again."""
    chosen_options = _check_options(tp, plan, options, settings)
    model, example, captured = prepared.model, prepared.example, prepared.captured
    chosen = choose_plan(model, captured, example, machine_for(), options=chosen_options, given=plan)
    modules, comms = build_ranks(captured, chosen, recompute=chosen_options.recompute)
    if modules_hook is not None:
        modules_hook(modules, comms)
    reference = copy.deepcopy(model).train()
    inputs = example.flat
    policy = chosen_options.mixed_precision  # the unsharded model and every rank under its autocast alike
    with torch.random.fork_rng(devices=[]), MixedPrecision.autocast_of(policy):
        torch.manual_seed(SEED)
        ref_out = example.call(reference, model_kwargs(model))
    ref_loss, weights = _loss(ref_out)
    ref_loss.backward()
    ranks = _simulate(modules, comms, inputs, weights, policy)
    read = frozenset(captured.aliases.get(captured.param_name(n.target), "")
                     for n in captured.graph.find_nodes(op="get_attr") if n.users)
    report = CheckReport(tp=chosen.tp, plan=chosen, read=read)
    compare = _Compare(report)
    _compare_step(compare, chosen, captured, reference, ranks, ref_out, ref_loss)
    if not report.exact and report.mismatch.what in ("output", "loss") and chosen.options.cp == 1:
        report.located = locate(captured, chosen, modules, comms, inputs)
    if not report.exact:
        return _checked_wider(model, prepared.example_inputs, chosen, report, modules_hook)
    return report


_NARROW = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes whose differences a wider check may show to be rounding (a bf16 sum over two ranks' halves is rounded
at other places than the whole sum, by far more than the float32 tolerances)."""


def _checked_wider(model: nn.Module, example_inputs, plan: Plan, report: CheckReport,
                   modules_hook) -> CheckReport:
    """The check again in float64 of a float32 (or bf16/fp16) model that differed: exact there means the difference
    is rounding (kept in ``rounding``); anything else keeps the first report. A bf16/fp16 model that cannot run in
    float64 (a kernel without float64, a cast of its own) is checked in float32, whose tolerances still catch a
    fault below bf16's rounding. A model that runs in no wider dtype keeps the first report; an error of autotp's
    in the wider check is raised, not taken for that."""
    floats = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    if not floats or any(t.dtype not in _NARROW for t in floats):
        return report
    wider = [torch.float64] + ([torch.float32] if any(t.dtype != torch.float32 for t in floats) else [])
    for dtype in wider:
        wide = _check_in(dtype, model, example_inputs, plan, report.tp, modules_hook)
        if wide is None:  # the model does not run in this dtype: try the next
            continue
        if not wide.exact:
            return report
        wide.rounding, wide.widened = report.mismatch, str(dtype).removeprefix("torch.")
        return wide
    return report


def _check_in(dtype: torch.dtype, model: nn.Module, example_inputs, plan: Plan, tp: int,
              modules_hook) -> CheckReport | None:
    """``check`` of ``model`` and its floating inputs cast to ``dtype``, or None where the model's own forward (or
    its export) fails in that dtype: that is the model's, and says nothing about rounding."""
    wide_model = copy.deepcopy(model).to(dtype)
    widened = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                       example_inputs)
    try:  # the model alone first
        with torch.no_grad():
            example_inputs_of(wide_model, widened).call(copy.deepcopy(wide_model), model_kwargs(wide_model))
    except Exception:  # noqa: BLE001 - any error of the model's own forward, which autotp does not run here
        return None
    try:
        return check(wide_model, tp, widened, plan=plan, modules_hook=modules_hook, recompute=plan.options.recompute)
    except CaptureError:  # the export failed in this dtype where the model's own dtype's did not: its dtypes
        return None


def _compare_step(compare: _Compare, plan: Plan, captured: Captured, reference: nn.Module, ranks: list[_Rank],
                  ref_out, ref_loss) -> None:
    for r in ranks:
        for i, (got, want) in enumerate(zip(tree_leaves(r.output), tree_leaves(ref_out))):
            if isinstance(want, torch.Tensor):
                compare("output", f"output {i} on rank {r.comm.rank}", got, want)
        compare("loss", f"loss on rank {r.comm.rank}", r.loss, ref_loss)
    for first in range(0, len(ranks), plan.tp):  # each cp rank's (dp replica's) tp group holds the whole model
        _compare_params(compare, plan, captured, reference, ranks[first:first + plan.tp])
    if above_tp(plan):
        compare_experts(compare, plan, captured, reference, ranks, LR)
    _compare_buffers(compare, captured, reference, ranks)


def _compare_params(compare: _Compare, plan: Plan, captured: Captured, reference: nn.Module,
                    ranks: list[_Rank]) -> None:
    """The gradients and parameters after a step of one group of tp ranks against the unsharded model's."""
    per_rank = [{captured.aliases.get(captured.param_name(k), k): p for k, p in r.module.named_parameters()}
                for r in ranks]
    ref_params = dict(reference.named_parameters())
    spread = expert_names(plan) if above_tp(plan) else set()  # gathered over their ep groups instead
    for name, ref_param in ref_params.items():
        if name not in per_rank[0] or name in spread:
            continue
        grads = [rank[name].grad if rank[name].grad is not None else torch.zeros_like(rank[name]) for rank in per_rank]
        want = ref_param.grad if ref_param.grad is not None else torch.zeros_like(ref_param)
        if not compare("gradient", f"{name}", full_tensor(plan.placements.get(name), grads), want):
            continue
        after = [rank[name].detach() - LR * g for rank, g in zip(per_rank, grads)]
        compare("parameter after a step", name, full_tensor(plan.placements.get(name), after), ref_param.detach() - LR * want)


def _compare_buffers(compare: _Compare, captured: Captured, reference: nn.Module, ranks: list[_Rank]) -> None:
    """Every rank's floating-point buffers after the step (a batch norm's running statistics, which the forward
    updates): buffers are never split, so each rank's must equal the unsharded model's."""
    ref_buffers = dict(reference.named_buffers())
    for r in ranks:
        for target, got in r.module.named_buffers():
            name = captured.aliases.get(captured.param_name(target), captured.param_name(target))
            want = ref_buffers.get(name)
            if want is not None and want.is_floating_point() and got.shape == want.shape:
                compare("buffer after a step", f"{name} on rank {r.comm.rank}", got, want)


def _values(module: fx.GraphModule, inputs: tuple) -> dict[str, torch.Tensor]:
    """Every node's value in a forward of ``module``, keyed by the original node it stands for."""
    out: dict[str, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            if isinstance(value, torch.Tensor):
                out[n.meta.get(STANDS_FOR, n.name)] = value.detach()
            return value

    with torch.no_grad():
        Recorder(module).run(*inputs)
    return out


def locate(captured: Captured, plan: Plan, modules: list[fx.GraphModule], comms: list[ThreadComm],
           inputs: tuple) -> Mismatch | None:
    """The first forward operation (in graph order) whose value on some rank differs from the unsharded one,
    replaying the forward of ``modules`` (as they are, faults included) over ``comms``."""
    analysis = captured.analysis
    layouts = analysis.propagate_placements(plan.placements, plan.tp, plan.sequence_parallel).layouts
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        want = _values(captured.module, inputs)
    results: list[dict] = [{} for _ in modules]

    def run(rank: int):
        comms[rank].calls = 0
        for m in modules[rank].modules():
            if hasattr(m, "stream"):
                m.stream.manual_seed(SEED)
        results[rank] = _values(modules[rank], inputs)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(modules))]
    for t in threads:
        t.start()
    join_fully(threads)
    for node in captured.graph.nodes:
        if node.name not in want or node.op in ("placeholder", "get_attr"):
            continue
        for rank, got in enumerate(results):
            if node.name not in got:
                continue
            lay = layouts.get(node.name)
            expected = want[node.name]
            if isinstance(lay, Shard):
                expected = local_part(expected, lay, rank % plan.tp, plan.tp)  # replicas: tp innermost
            value = got[node.name]
            if not close(value, expected):
                error = float((value.float() - expected.float()).abs().max()) if value.shape == expected.shape \
                    else float("inf")
                op = getattr(node.target, "__name__", str(node.target))
                where = f"{captured.module_name(node) or '(top level)'} ({op}, node {node.name}) on rank {rank}"
                return Mismatch("activation", where, f"sizes {list(expected.shape)}", error)
    return None
