"""The pictures: graph content (decisions, collectives, stages, collapsed blocks), layout, renderers, timelines,
and the table's numbers. Pipeline plans are built by hand (``plan.replace(pp=2, stages=...)``)."""

import xml.etree.ElementTree as ET

import networkx as nx
import pytest

import autotp
from autotp.capture import capture
from autotp.planning import Collective, PlacementKind, Stage
from autotp.tools.report import (
    collapse_names,
    collective_bytes,
    human_bytes,
    module_rows,
    param_infos,
    plan_table,
)
from autotp.tools.viz import (
    Box,
    PictureFormat,
    Schedule,
    draw_graph,
    draw_timeline,
    format_for,
    save,
    simulate,
    to_dot,
    viz_graph,
)
from autotp.tools.viz.groups import module_groups
from autotp.tools.viz.layout import layered_layout
from tests import models

EXAMPLE = (models.tokens(2, 16, 0),)


@pytest.fixture(scope="module")
def gpt():
    model = models.build("gpt")
    plan = autotp.plan(model, tp=2, vocab="split", example_inputs=EXAMPLE)
    stages = (Stage(0, ("transformer.wte", "transformer.wpe", "transformer.h.0"), 1.0e9, 60_000, 1e6, 4096.0),
              Stage(1, ("transformer.h.1", "transformer.ln_f", "lm_head"), 1.2e9, 52_000, 1e6))
    return dict(model=model, captured=capture(model, EXAMPLE), plan=plan, params=param_infos(model),
                piped=plan.replace(pp=2, stages=stages))


def _split_modules(plan, params):
    return [r.name for r in module_rows(plan, params) if r.kind != "replicated"]


def test_groups_are_modules_and_acyclic(gpt):
    g = module_groups(gpt["captured"])
    assert nx.is_directed_acyclic_graph(g)
    modules = [g.nodes[n]["module"] for n in g]
    for linear in ("transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"):
        assert modules.count(linear) == 1
    attn = next(n for n in g if g.nodes[n]["module"] == "transformer.h.0.attn")
    assert "scaled_dot_product_attention" in g.nodes[attn]["ops"]  # the attention core is one box


def test_expanded_graph_has_every_decision_and_collective(gpt):
    vg = viz_graph(gpt["captured"], gpt["plan"], gpt["params"], 8, 32, collapse=False)
    by_title = {n.title: n for n in vg.nodes}
    assert by_title["transformer.h.1.attn.c_attn"].decision is PlacementKind.COLWISE
    assert by_title["transformer.h.1.mlp.c_proj"].decision is PlacementKind.ROWWISE
    assert by_title["lm_head"].decision is PlacementKind.VOCAB
    assert by_title["transformer.ln_f"].decision is PlacementKind.REPLICATED
    assert "192×64 → 96×64" in by_title["transformer.h.0.attn.c_attn"].detail
    collectives = [n for n in vg.nodes if n.decision is Box.COLLECTIVE]
    assert len(collectives) == len(gpt["plan"].collectives)
    assert "64 KiB" in collectives[0].detail  # B*T*64 floats at batch 8, seq 32
    # g sits between the row-split projection and the residual add it feeds
    ids = {n.id: n for n in vg.nodes}
    row = by_title["transformer.h.0.attn.c_proj"].id
    after = [ids[v] for u, v in vg.edges if u == row]
    assert [n.title for n in after] == ["all-reduce (g, forward)"]


def test_collapsed_blocks_keep_names_in_tooltips(gpt):
    vg = viz_graph(gpt["captured"], gpt["plan"], gpt["params"], 8, 32)
    collapsed = [n for n in vg.nodes if n.decision is Box.COLLAPSED]
    assert len(collapsed) == 1 and collapsed[0].title == "transformer.h.1"
    text = " ".join(f"{n.title} {n.tooltip}" for n in vg.nodes)
    assert all(m in text for m in _split_modules(gpt["plan"], gpt["params"]))
    assert nx.is_directed_acyclic_graph(nx.DiGraph(list(vg.edges)))


def test_stages_become_clusters(gpt):
    vg = viz_graph(gpt["captured"], gpt["piped"], gpt["params"], 8, 32)
    stage = {n.title: n.stage for n in vg.nodes}
    assert stage["transformer.wte"] == stage["transformer.h.0.attn.c_attn"] == 0
    assert stage["transformer.h.1.attn.c_attn"] == stage["lm_head"] == stage["output"] == 1
    assert not any(n.decision is Box.COLLAPSED for n in vg.nodes)  # one block per stage: nothing repeats
    assert [label.split(" ·")[0] for _, label in vg.stages] == ["stage 0", "stage 1"]
    dot = to_dot(vg)
    assert "subgraph cluster_stage1" in dot and 'shape="hexagon"' in dot and dot.count("{") == dot.count("}")


def test_svg_and_html_name_split_modules_and_stages(gpt, tmp_path):
    vg = viz_graph(gpt["captured"], gpt["piped"], gpt["params"], 8, 32)
    fig, tooltips = draw_graph(vg)
    svg_path, html_path = tmp_path / "p.svg", tmp_path / "p.html"
    save(fig, str(svg_path), PictureFormat.SVG, vg.title, tooltips)
    save(fig, str(html_path), PictureFormat.HTML, vg.title, tooltips, text="TABLE-TEXT")
    text = " ".join(t for t in ET.parse(svg_path).getroot().itertext())
    for name in [*_split_modules(gpt["plan"], gpt["params"]), "stage 1 ·", "column-split", "all-reduce"]:
        assert name in text
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "TABLE-TEXT" in page


def test_layout_keeps_boxes_apart_and_edges_attached():
    order = ["a", "b", "c", "d"]
    sizes = {n: (1.0, 0.4) for n in order}
    edges = [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("a", "d")]
    lay = layered_layout(order, sizes, edges)
    (xb, yb), (xc, yc) = lay.centers["b"], lay.centers["c"]
    assert yb == yc and abs(xb - xc) >= 1.0  # same layer, no overlap
    route = lay.routes[("a", "d")]  # a long edge: through a dummy point beside b and c
    assert route[0] == (lay.centers["a"][0], lay.centers["a"][1] + 0.2)
    assert route[-1] == (lay.centers["d"][0], lay.centers["d"][1] - 0.2) and len(route) == 3


@pytest.mark.parametrize("schedule", list(Schedule))
def test_timeline_bubble_matches_the_formula(schedule):
    stages, micro = 4, 8
    t = simulate([1.0] * stages, micro, schedule)
    assert t.bubble == pytest.approx((stages - 1) / (micro + stages - 1))
    for s in range(stages):  # one thing at a time per stage, forwards before their backwards
        boxes = sorted((b for b in t.boxes if b.stage == s), key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(boxes, boxes[1:]))
    ends = {(b.phase, b.stage, b.micro): b for b in t.boxes}
    assert all(ends[("F", s - 1, m)].end <= ends[("F", s, m)].start for s in range(1, stages) for m in range(micro))


def test_timeline_is_sized_by_stage_cost(tmp_path):
    t = simulate([1.0, 2.0], 4, Schedule.ONE_F_ONE_B)
    f1 = next(b for b in t.boxes if b.stage == 1 and b.phase == "F")
    b1 = next(b for b in t.boxes if b.stage == 1 and b.phase == "B")
    assert f1.end - f1.start == 2.0 and b1.end - b1.start == 4.0  # backward = 2 x forward
    fig = draw_timeline(t, ["stage 0", "stage 1"], "demo")
    save(fig, str(tmp_path / "t.svg"), PictureFormat.SVG, "demo")
    assert "bubble" in (tmp_path / "t.svg").read_text()


def test_picture_format_from_name_or_flag():
    assert format_for("a/plan.PNG") is PictureFormat.PNG and format_for("x", "dot") is PictureFormat.DOT
    with pytest.raises(autotp.InputError, match="svg, png, html, dot"):
        format_for("plan.jpg")


def test_table_numbers_and_stages(gpt):
    c = Collective("all_reduce", "forward", "g", "m", ("B", "T", "64"))
    assert collective_bytes(c, 8, 32) == 8 * 32 * 64 * 4
    assert collective_bytes(Collective("all_reduce", "forward", "g", "m", ("B", "s9")), 8, 32) is None
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(None) == "?"
    assert collapse_names([("h.0.fc", (1,)), ("h.1.fc", (1,)), ("h.2.fc", (2,))]) == [
        ("h.[0-1].fc", (1,), 2), ("h.2.fc", (2,), 1)]
    text = plan_table(gpt["piped"], gpt["params"], 8, 32)
    assert "transformer.h.[0-1].attn.c_attn (x2)  column  [192, 64] + [192]  [96, 64] + [96]" in text
    assert "Pipeline stages (pp=2" in text and "imbalance (max/mean): compute 1.091" in text
    assert "vs 439 KiB unsharded" in text


def test_bare_parameter_projections_are_their_own_boxes():
    model = models.build("raw_gpt")
    plan = autotp.plan(model, tp=2, vocab="split", example_inputs=EXAMPLE)
    vg = viz_graph(capture(model, EXAMPLE), plan, param_infos(model), 8, 32, collapse=False)
    by_id = {n.id: n for n in vg.nodes}
    titles = {n.title: n for n in vg.nodes}
    assert titles["blocks.1.w_qkv"].decision is PlacementKind.COLWISE and titles["blocks.1.w_down"].decision is PlacementKind.ROWWISE
    after = {by_id[u].title: by_id[v].title for u, v in vg.edges if by_id[v].decision is Box.COLLECTIVE}
    assert after["blocks.0.w_out"] == "all-reduce (g, forward)"  # the module's second projection, not its first
    assert after["blocks.1.w_down"] == "all-reduce (g, forward)"
