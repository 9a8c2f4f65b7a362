"""The planner: from a captured graph to a ``Plan`` (Megatron's column/row scheme, found automatically).

It runs the read-only passes, turns the regions they find into per-parameter placements, refuses
sizes that tp does not divide (naming the layer, the size and the tp values that work), keeps
anything unmatched replicated, and lists the collectives the rewrite will insert. The vocabulary's split is
``vocab_split``'s, the list of collectives ``planned_collectives``'.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from autotp.capture import Captured
from autotp.errors import PlanError
from autotp.options import Options
from autotp.passes.analysis import Analysis
from autotp.planning.expert_layout import expert_banks, expert_notes
from autotp.passes.grouped_banks import banks_of, expert_placements
from autotp.passes.loop_banks import bank_loops, loop_banks
from autotp.passes.choices import whole_convolutions
from autotp.passes.graph import sizes
from autotp.passes.placement import REPLICATED, Placement, PlacementKind
from autotp.passes.expert_banks import per_expert
from autotp.passes.routed_experts import expert_layers
from autotp.passes.projections import conv_groups, packed_by_weight, packed_segments
from autotp.passes.propagation import Propagation
from autotp.passes.random_ops import random_refusal
from autotp.passes.region_match import RegionKind, RegionMatch
from autotp.passes.steps import Operator
from autotp.planning.adapter_placements import adapter_placements, embedding_adapter_placements, without_adapters
from autotp.planning.consistency import check_biases_follow_weights
from autotp.planning.plan import (
    Collective,
    Plan,
    Region,
    check_schedule_fits,
    region_contradictions,
)
from autotp.planning.planned_collectives import planned_collectives
from autotp.planning.machines import MACHINES, Link, Machine
from autotp.planning.pricing import (
    region_cost,
    regions_kept_whole,
    training_bytes_per_rank,
)
from autotp.planning.stage_split import plan_stages
from autotp.planning.vocab_split import vocab_placements


def _divisibility_error(analysis: Analysis, region: RegionMatch, tp: int, valid: list[int]) -> PlanError:
    # Blame the heads first: a width that tp does not divide follows from heads it does not divide.
    v = min(region.violations, key=lambda v: not v.what.startswith("dim"))
    layers = ", ".join(dict.fromkeys(analysis.layer(c) for c in region.columns))
    where = analysis.module(v.node) or v.node
    if v.what.startswith("dim"):
        heads = " (the attention heads)" if region.kind is RegionKind.ATTENTION else ""
        what = f"{v.what} at {where} has size {v.size}{heads}, which is"
    else:
        what = f"{v.what} ({v.size}, at {where}) are"
    return PlanError(
        f"cannot split the {region.kind.value} at '{layers}' across tp={tp}: its {what} not divisible by {tp}; "
        f"Megatron's split gives every rank an equal whole share. "
        f"Valid tp values for this model: {', '.join(map(str, valid))}. Set tp to one of them.")


def _chosen_whole(analysis: Analysis, unmatched) -> dict[str, str]:
    """Unmatched projections kept whole on purpose (``choices.kept_by_choice``), with why."""
    chosen = analysis.chosen_whole
    return {n: chosen[n] for nodes, _ in unmatched for n in nodes if n in chosen}


def _unmatched_note(analysis: Analysis, nodes: tuple[str, ...], why: str, chosen: dict[str, str]) -> str:
    """Why projections were kept whole: by choice (a transform before the LM head, a router), else the
    blocking op."""
    layers = ", ".join(dict.fromkeys(analysis.layer(n) for n in nodes))  # a bank's experts: its name once
    reasons = {chosen.get(n) for n in nodes}
    if len(reasons) == 1 and None not in reasons:
        return f"{layers} kept whole by choice: {reasons.pop()}"
    return f"{layers} kept replicated: {why}"


def _whole_convolution_notes(analysis: Analysis, by_target: dict[str, Placement], whys: dict[str, str],
                             chosen: dict[str, str]) -> list[str]:
    """One note per convolution kept whole (a patch embedding, an audio front end), saying why: ``whys``, by node,
    the region search's reason (a projection that closed no region, a grouped convolution that opened none);
    ``chosen``: grouped convolutions kept whole on purpose (``openings``), by node, with why."""
    split = {t for t, p in by_target.items() if p.is_split}
    notes = []
    for node, weight in whole_convolutions(analysis.graph, split):
        if node.name in chosen:
            notes.append(f"{analysis.layer(node.name)} kept whole by choice: {chosen[node.name]}")
            continue
        dense = conv_groups(node) == 1
        why = whys.get(node.name) or _unsplit_convolution_why(node, analysis.captured.param_name(weight), dense)
        notes.append(f"{analysis.module(node.name) or weight} kept whole: a {'dense' if dense else 'grouped'} "
                     f"convolution (weight sizes {list(sizes(node.args[1]))}) that no exact split reaches ({why}); "
                     "autotp splits a dense convolution by its output channels up to one split by its input channels "
                     "(or alone by its input channels), a grouped one with its channels by whole groups, so it runs "
                     "whole on every rank")
    noted = {node.name for node, _ in whole_convolutions(analysis.graph, split)}
    # one whose weight is computed from a parameter (weight normalisation) is not among them: noted here
    notes += [f"{analysis.layer(node)} kept whole by choice: {why}" for node, why in chosen.items() if node not in noted]
    return notes


def _unsplit_convolution_why(node: fx.Node, weight: str, dense: bool) -> str:
    """Why a convolution no region search looked at stays whole: a dense one whose weight is computed from its
    parameter (weight standardisation), which splits only by whole groups; else a grouped one no split reaches."""
    if dense and not (isinstance(node.args[1], fx.Node) and node.args[1].op == "get_attr"):
        return (f"its weight is computed from {weight} before it convolves (a weight standardisation or "
                "normalisation), and autotp splits a computed weight only for a grouped convolution")
    return "no split of its input channels reaches it by whole groups"


def _shared_note(analysis: Analysis, region: RegionMatch, tp: int) -> str:
    """What a region whose K/V heads tp exceeds keeps: each rank the KV heads its query heads use, and a fused
    projection (all of the region's columns) its queries too, each chunk held by several ranks."""
    holders = max(n for _, n in region.shared)
    layers = ", ".join(analysis.layer(n) for n, _ in region.shared)
    if len(region.shared) == len(region.columns):
        return (f"{layers}: tp={tp} exceeds the heads of its K/V parts, so each of its parts is cut in {tp // holders} "
                f"chunks held by {holders} ranks each (the KV heads the holders' query heads use), each rank taking its "
                "own query heads where they meet the keys, and its gradient is summed over the holders")
    return (f"{layers}: tp={tp} exceeds their heads, so each rank keeps only the heads its query heads use, {holders} "
            "ranks per head, and their gradients are summed over those ranks")


def _valid_tp(analysis: Analysis, regions: list[RegionMatch]) -> list[int]:
    """Every tp at which each region splits. The sizes one tp checks are not those another does (past the KV
    heads, ranks share K/V instead of splitting them), so each candidate (a divisor of a size checked here)
    is searched again; only on the error path."""
    candidates = sorted({t for s in {s for r in regions for s in r.sizes} for t in range(1, s + 1) if s % t == 0})
    return [t for t in candidates if not any(r.violations for r in analysis.regions(t).regions)]


def _region_placements(analysis: Analysis, region: RegionMatch) -> dict[str, Placement]:
    out: dict[str, Placement] = {}
    shared = dict(region.shared)
    segments_of = dict(zip(region.columns, region.segments))
    packed = packed_by_weight([analysis.projections[c] for c in region.columns])
    for col, segments in segments_of.items():
        p = analysis.projections[col]
        if p.packed is not None:  # the parameter holds every slice's segments side by side
            segments = packed_segments(packed[p.weight], segments_of)
        # every expert's columns split alike: the parameter's segments are those of each expert
        stored = per_expert(p, segments or (p.out_features,)) if p.experts > 1 else segments
        out[p.weight] = Placement(PlacementKind.COLWISE, p.out_dim, stored, shared.get(col, 1))
        if p.bias:
            out[p.bias] = Placement(PlacementKind.COLWISE, 0, segments, shared.get(col, 1))
    for row, segments in zip(region.rows, region.row_segments or [()] * len(region.rows)):
        p = analysis.projections[row]
        if p.experts > 1:  # every expert's rows split alike: the parameter's segments are those of each expert
            segments = per_expert(p, segments or (p.in_features,))
        out[p.weight] = Placement(PlacementKind.ROWWISE, p.in_dim, segments)
    for target, shard in region.params:
        whole = shard.segments == (analysis.param_size(target, shard.dim),)
        # a parameter met by a chunk several ranks hold (a per-head norm weight of shared KV heads) is held alike:
        # split tp ways, its heads would not go round
        out[target] = Placement(PlacementKind.COLWISE, shard.dim, () if whole else shard.segments, shard.replicas)
    return out


def _choose_regions(analysis: Analysis, regions: list[RegionMatch], tp: int, values: dict[str, int],
                    options: Options, link: Link, notes: list[str]) -> tuple[list[RegionMatch], tuple[str, ...]]:
    """The regions to split, and the layers of those the cost model keeps whole within the memory budget."""
    if options.memory_budget is None or tp == 1:
        return regions, ()
    everything = {}
    for region in regions:
        everything |= _region_placements(analysis, region)
    costs = [region_cost(analysis, r, tp, values, link) for r in regions]
    kept = regions_kept_whole(costs, training_bytes_per_rank(analysis, everything, tp), options.memory_budget)
    if not kept:
        return regions, ()
    layers = tuple(analysis.layer(n) for c in kept for n in (*c.region.columns, *c.region.rows))
    saved = sum(c.gain for c in kept)
    notes.append(f"{len(kept)} of {len(regions)} regions kept whole by the cost model ({link.name}, at the "
                 f"plan's batch and sequence; within the memory budget of {options.memory_budget / 2**20:.4g} MiB): "
                 f"their splits would cost more communication than the compute they save, {saved * 1e3:.3g} ms per "
                 f"step in all ({', '.join(layers[:4])}{', ...' if len(layers) > 4 else ''})")
    whole = {id(c.region) for c in kept}
    return [r for r in regions if id(r) not in whole], layers


def verify_plan(captured: Captured, plan: Plan) -> Plan:
    """Re-check a plan made elsewhere (a file, a hand edit) the way the planner checks its own: every size it
    splits divides by tp, nothing it splits needs what the rewrite cannot do, and its regions agree with its
    placements (``PlanError`` otherwise). Returns the plan to apply, its report-only fields brought in line with its
    placements: collectives recomputed from them, regions they contradict dropped, each change said in a note."""
    if plan.tp == 1 and not expert_placements(captured, plan):
        return _reported(plan, plan.collectives)
    analysis = captured.analysis
    check_biases_follow_weights(analysis, _by_target(analysis, plan.placements))
    _check_expert_placements(captured, plan)
    prop = analysis.propagate_placements(plan.placements, plan.tp, plan.sequence_parallel)
    if prop.violations:
        v = prop.violations[0]
        raise PlanError(f"the plan cannot run at tp={plan.tp}: at {analysis.module(v.node) or v.node} ({v.what}) a "
                        f"size of {v.size} would be split, which tp={plan.tp} does not divide; fix the placements "
                        "of the layers before it or re-plan with autotp.plan")
    _refuse_inexact(analysis, prop)
    return _reported(plan, tuple(planned_collectives(analysis, prop, expert_placements(captured, plan),
                                                      plan.options.ep if plan.options else plan.tp)))


def _reported(plan: Plan, collectives: tuple[Collective, ...]) -> Plan:
    """``plan`` with its report-only fields matching its placements: ``collectives`` (what they imply), and only
    the regions they do not contradict; a note says what changed (never silently: a plan file's reports may have
    been edited, or gone stale when its placements were)."""
    why = {r: region_contradictions(r, plan.placements) for r in plan.regions}
    stale = [w for found in why.values() for w in found]
    notes = list(plan.notes)
    if collectives != plan.collectives:
        notes.append(f"collectives recomputed from the placements: the plan listed {len(plan.collectives)}, its "
                     f"placements imply {len(collectives)} (the list only reports them; edit placements instead)")
    if stale:
        notes.append(f"regions dropped, as the placements contradict them (regions only report placements): "
                     f"{'; '.join(stale)}")
    if not stale and collectives == plan.collectives:
        return plan
    kept = tuple(r for r in plan.regions if not why[r])
    return plan.replace(collectives=collectives, regions=kept, notes=tuple(notes))


def _check_expert_placements(captured: Captured, plan: Plan) -> None:
    """Refuse an ``expert`` placement the rewrite cannot honour: only a bank read by grouped matmuls, split along
    its experts (dim 0) into whole experts per rank, is computed expert by expert."""
    banks = banks_of(captured.analysis.graph) | loop_banks(captured.analysis.graph)
    for target, placement in expert_placements(captured, plan).items():
        name = captured.param_name(target)
        if target not in banks or placement.dim != 0 or placement.segments or placement.replicas != 1:
            raise PlanError(f"{name} is placed 'expert', which splits only a bank of experts read by grouped matmuls "
                            "or a loop over the experts, "
                            "along dim 0 with no segments; place it as autotp.plan does, or re-plan with ep")
        ep = plan.options.ep if plan.options else plan.tp
        if banks[target] % ep or ep % plan.tp:
            raise PlanError(f"{name} holds {banks[target]} experts, which ep={ep} ranks (a multiple of tp={plan.tp}) "
                            "cannot hold whole experts of evenly; re-plan with ep")


def _expert_split(captured: Captured, by_target: dict[str, Placement], options: Options,
                  sequence_parallel: bool) -> tuple[dict[str, Placement], list[str]]:
    """The banks ``options.ep`` splits by their experts (parameter name -> placement) and the notes it adds. A split
    the rewrite could not make exact (an expert's bias added in place to its rows, as GPT-OSS's) is not made: the
    experts stay under tensor parallelism, and the notes say why."""
    analysis, tp, ep = captured.analysis, options.tp, options.ep
    layers = expert_layers(analysis) if ep > 1 else ()
    banks = {captured.param_name(t): e for t, e in (banks_of(analysis.graph) | loop_banks(analysis.graph)).items()}
    split = expert_banks(layers, banks, ep, tp)
    if split:
        # the experts' other parameters (GPT-OSS's biases, picked per row) stay whole: their rows are dispatched
        modules = {n.rpartition(".")[0] for n in split}
        split |= {n: REPLICATED for n in captured.param_names if n not in split and n.rpartition(".")[0] in modules}
        trial = by_target | {captured.attr_target(captured.aliases.get(n, n)): p for n, p in split.items()}
        placements = {n: trial.get(captured.attr_target(captured.aliases[n]), REPLICATED) for n in captured.param_names}
        try:
            _refuse_inexact(analysis, analysis.propagate_placements(placements, tp, sequence_parallel))
        except PlanError as e:
            return {}, [f"{layer.module}: {layer.experts} routed experts kept under tensor parallelism at ep={ep}: "
                        f"split by their experts, {str(e).split(': ', 1)[-1].split(' (node')[0]}" for layer in layers]
    return split, expert_notes(layers, ep, tp, {n for n, p in split.items() if p.kind is PlacementKind.EXPERT},
                               tuple(bank_loops(analysis.graph)[1]) if layers else ())


def _refuse_inexact(analysis: Analysis, prop: Propagation) -> None:
    """Plan-time refusal of what the rewrite could not make exact (random draws, in-place writes)."""
    problems = list(prop.refusals)
    problems += [(n.name, why) for n in analysis.graph.nodes if (why := random_refusal(n, prop.layouts))]
    if problems:
        node, why = problems[0]
        raise PlanError(f"cannot split {analysis.module(node) or 'the model'} exactly: {why} (node {node}). "
                        "Use a tp that keeps this part whole, or change the model so the op reads whole values.")


def _by_target(analysis: Analysis, by_name: Mapping[str, Placement]) -> dict[str, Placement]:
    """Placements keyed by original name keyed by the ``get_attr`` target each parameter is read through."""
    captured = analysis.captured
    return {captured.attr_target(captured.aliases.get(n, n)): p for n, p in by_name.items()}


def cost_sizes(captured: Captured, batch: int | None, seq: int | None) -> dict[str, int]:
    """Values for the size symbols: the example's, with batch (``B``) and sequence (``T``) overridden."""
    sizes = dict(captured.example_sizes)
    wanted = {"B": batch, "T": seq}
    for symbol, readable in captured.dim_names.items():
        if wanted.get(readable) is not None:
            sizes[symbol] = wanted[readable]
    return sizes


def make_plan(captured: Captured, options: Options = Options(), machine: Machine = MACHINES["cpu"]) -> Plan:
    """Plan Megatron-style tensor parallelism over ``options.tp`` ranks and ``options.pp`` pipeline ranks
    (``options.stages`` stages in all), costs priced on ``machine`` at ``options.batch``/``seq`` (default: the
    example's sizes; a tensor-parallel group's collectives run over the node's link). The plan records
    ``options``."""
    tp = options.tp
    analysis = captured.analysis
    search = analysis.regions(tp)
    regions = search.regions
    chosen = _chosen_whole(analysis, search.unmatched)
    convolutions = {n for nodes, _ in search.unmatched for n in nodes if analysis.projections[n].spatial}
    notes: list[str] = [_unmatched_note(analysis, nodes, why, chosen) for nodes, why in search.unmatched
                        if not convolutions.issuperset(nodes) or chosen.keys() & set(nodes)]
    if captured.custom_functions:
        notes.append(f"the forward applies custom autograd Function(s) {', '.join(captured.custom_functions)}: "
                     "torch.export keeps their forward only, so training uses autograd's gradient of that forward, "
                     "not their own backward; autotp.check(model, tp) shows whether that is the same for this model "
                     "(not for gradient reversal or straight-through estimators)")
    by_target: dict[str, Placement] = {}
    plan_regions: list[Region] = []
    sizes = cost_sizes(captured, options.batch, options.seq)
    whys = {n: why for nodes, why in search.unmatched for n in nodes} | {o.node: o.why for o in search.openings}
    convolutions_kept = {o.node: o.why for o in search.openings if o.by_choice}
    # Channels a CNN's width does not divide by tp (55 at tp=2) keep those convolutions whole, with a note; the
    # transformer regions' sizes (heads, widths) are the user's to match, so tp is refused there.
    uneven = [r for r in regions if r.violations and r.kind is RegionKind.CONVOLUTION]
    for region in uneven:
        v = region.violations[0]
        whys |= dict.fromkeys((*region.columns, *region.rows), f"its {v.what} ({v.size}) do not divide by tp={tp}")
        notes += [f"{analysis.layer(c)} kept whole: a grouped convolution whose {v.what} ({v.size}) do not divide "
                  f"by tp={tp}" for c in region.convolutions]
    regions = [r for r in regions if not (r.violations and r.kind is RegionKind.CONVOLUTION)]
    for region in regions:
        if region.violations:
            raise _divisibility_error(analysis, region, tp, _valid_tp(analysis, regions))
    regions = without_adapters(regions, analysis.adapters, analysis.embedding_adapters)  # placed by their bases below
    regions, regions_kept = _choose_regions(analysis, regions, tp, sizes, options, machine.node, notes)
    for region in regions:
        by_target |= _region_placements(analysis, region)
        if region.kind is RegionKind.ROW:
            made = (f"its input, made from {', '.join(analysis.captured.param_name(t) for t, _ in region.params)} "
                    "alone, split with it" if region.params else "its whole input sliced")
            notes.append(f"{analysis.layer(region.rows[0])} split alone by its input features ({made}, its output "
                         f"all-reduced), as no column split closes around it: {region.why}")
        if region.shared:
            notes.append(_shared_note(analysis, region, tp))
        kept = tuple(analysis.layer(n) for n in region.replicated)
        if kept:
            notes.append(f"{', '.join(kept)} kept replicated: tp={tp} does not divide their heads; "
                         "each rank selects the heads it needs")
        plan_regions.append(Region(region.kind, tuple(analysis.layer(c) for c in (*region.columns, *region.convolutions)),
                                   tuple(analysis.layer(r) for r in region.rows), kept))
    by_target |= adapter_placements(analysis, by_target)
    notes += _whole_convolution_notes(analysis, by_target, whys, convolutions_kept)
    vocab, vocab_regions, vocab_kept = vocab_placements(analysis, tp, notes, options, machine.node, sizes, by_target)
    by_target |= vocab
    by_target |= embedding_adapter_placements(analysis, by_target)
    plan_regions = vocab_regions[:1] + plan_regions + vocab_regions[1:]
    if tp == 1:
        by_target = {}  # one rank holds everything: the regions are found, but nothing is split
    sequence_parallel = options.sequence_parallel and tp > 1
    if sequence_parallel:
        _check_sequence_parallel(analysis)
    split_banks, ep_notes = _expert_split(captured, by_target, options, sequence_parallel)
    notes += ep_notes
    by_target |= {captured.attr_target(captured.aliases.get(n, n)): p for n, p in split_banks.items()}
    placements = {name: by_target.get(captured.attr_target(captured.aliases[name]), REPLICATED)
                  for name in captured.param_names}
    prop = analysis.propagate_placements(placements, tp, sequence_parallel)
    if sequence_parallel:
        notes += _sequence_notes(analysis, prop)
    _refuse_inexact(analysis, prop)
    planned_stages = plan_stages(analysis, prop, tp, options.stages, options.balance, sizes, options.cuts)
    by_name = {captured.dim_names.get(k, k): v for k, v in sizes.items()}
    plan = Plan(tp=tp, placements=placements, collectives=tuple(planned_collectives(
                    analysis, prop, {captured.attr_target(captured.aliases.get(n, n)) for n, p in split_banks.items()
                                     if p.kind is PlacementKind.EXPERT}, options.ep)),
                regions=tuple(plan_regions), notes=tuple(notes), model=captured.model_name, pp=options.pp,
                stages=planned_stages, balance=options.balance, batch=by_name.get("B", 0), seq=by_name.get("T", 0),
                by_choice=tuple(sorted({*(analysis.layer(n) for n in {*chosen, *convolutions_kept}), *vocab_kept,
                                        *regions_kept})),
                sequence_parallel=sequence_parallel, options=options)
    return check_schedule_fits(plan, options)


def _sequence_notes(analysis: Analysis, prop: Propagation) -> list[str]:
    """What sequence parallelism leaves all-reduced: rows whose output has no sequence dim (computed on tokens
    flattened into one dim, as GPT-2's ``Conv1D`` does), whose split would not line up with the sequence's."""
    kept = sorted({analysis.layer(n) for n, op in prop.reduced.items() if op is Operator.G and n in analysis.projections})
    if not kept:
        return []
    return [f"sequence_parallel: {', '.join(kept)} keep their all-reduce (their output has no sequence dim: tokens "
            "flattened into one), and their readers on the sequence-split stream slice it per rank"]


def _check_sequence_parallel(analysis: Analysis) -> None:
    """Sequence parallelism needs a sequence to split: the dynamic length of the ids an embedding looks up."""
    if not analysis.sequence_sizes:
        raise PlanError(f"sequence_parallel=True splits the residual stream along the sequence of the token ids an "
                        f"embedding looks up, and {analysis.captured.model_name} has no such ids with a dynamic "
                        "sequence length: leave sequence_parallel off for this model")
