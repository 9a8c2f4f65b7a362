"""LoRA (peft) at tensor and pipeline parallelism: the adapters split at their base layer's communication, found
from the graph (``passes.adapters``), trained exactly, the frozen base left alone."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import autotp
from tests import lora_workers, models
from tests.distributed import run_on_ranks

WIDE = 64 * 4
"""Bytes of one (B=2, T=8, 64) activation in float32 divided by B*T: activations are at least this per token."""


def _by_size(events, tokens: int) -> tuple[int, int]:
    """(collectives of activations, of smaller values: weight-gradient shares) among (collective, bytes) events."""
    wide = sum(1 for _, n in events if n >= tokens * WIDE)
    return wide, len(events) - wide


def test_plan_splits_adapters_like_their_base_layers():
    model = lora_workers.adapted(layers=1)
    plan = autotp.plan(model, tp=2, example_inputs=(models.tokens(2, 8, 1),))
    at = "base_model.model.model.layers.0."
    want = {"self_attn.q_proj": ("replicated", "colwise(dim=0)"), "mlp.up_proj": ("replicated", "colwise(dim=0)"),
            "self_attn.o_proj": ("rowwise(dim=1)", "replicated"), "mlp.down_proj": ("rowwise(dim=1)", "replicated")}
    for layer, (a, b) in want.items():
        assert repr(plan.placements[f"{at}{layer}.lora_A.default.weight"]) == a, layer
        assert repr(plan.placements[f"{at}{layer}.lora_B.default.weight"]) == b, layer
    assert not any("split alone" in note for note in plan.notes)  # no adapter is all-reduced on its own


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checker_exact_at_tp_4_at_the_base_models_forward_collectives(dropout):
    """tp=4 exceeds the 2 KV heads: K/V and their adapters' B are held by two ranks per chunk."""
    x = models.tokens(2, 8, 1)
    report = autotp.check(lora_workers.adapted(dropout), tp=4, example_inputs=(x,))
    assert report.exact, str(report)
    base = autotp.plan(lora_workers.llama(), tp=4, example_inputs=(x,))
    assert len(_split(report.plan, "forward", lora_workers.RANK)[0]) == len(_split(base, "forward")[0])
    assert not _split(report.plan, "forward", lora_workers.RANK)[1]
    backward = [c.operator.value for c in report.plan.collectives if c.direction.value == "backward"]
    assert backward.count("grad_sum") == 1  # every adapter's gradient share in one all-reduce
    # K/V's B chunks, each held by two ranks, sum their holders' shares (shared_grad) as the base's K/V weights do
    assert len(backward) <= len([c for c in base.collectives if c.direction.value == "backward"])


def test_collectives_are_the_base_models_forward_and_backward():
    """Forward the base model's collectives; backward its activation all-reduces (one fewer: the frozen embedding
    needs no gradient) and one bucket summing every adapter's whole-matrix gradient share (``rewrite.grad_bucket``)."""
    result = run_on_ranks(lora_workers.collectives, 2)[0]
    adapted, base = result["adapted"], result["base"]
    tokens = 2 * 8
    assert _by_size(adapted["forward"], tokens) == _by_size(base["forward"], tokens)
    assert len(adapted["forward"]) == len(base["forward"])
    *activations, bucket = adapted["backward"]
    print(f"forward {len(adapted['forward'])} (base {len(base['forward'])}); backward {len(activations)} activations "
          f"+ 1 bucket of {bucket[1]} bytes (base {len(base['backward'])})")
    assert len(adapted["backward"]) == len(base["backward"])
    assert activations == base["backward"][1:]
    layers = 2 * len(lora_workers.TARGETS)  # each adapter's one whole r x 64 matrix, float32, in the one bucket
    assert bucket == ["all_reduce", layers * lora_workers.RANK * 64 * 4]


def test_biased_row_layers_carry_their_adapters_in_the_base_all_reduce():
    """A row-split base with a bias (GPT-2's ``Conv1D``, an ``nn.Linear``): the adapter's partial sum joins the base's
    one all-reduce and the bias is added once (by one rank), so forward makes the base model's collectives; backward
    the base's activation all-reduces and one bucket. Exact with the biases trained too (peft's ``bias="all"``)."""
    for name, r in run_on_ranks(lora_workers.biased_rows, 2)[0].items():
        _at_the_base_models_collectives(name, r)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("tp,pp,dp,dropout", [(2, 1, 1, 0.0), (2, 1, 1, 0.1), (2, 2, 1, 0.0), (2, 1, 2, 0.0),
                                              pytest.param(2, 2, 2, 0.0, marks=SLOW),
                                              pytest.param(4, 1, 1, 0.0, marks=SLOW)])
def test_clipped_adamw_steps_exact_and_frozen_base_untouched(tp, pp, dp, dropout):
    """Exact after clipped AdamW steps; each step sums the adapters' gradient shares in one all-reduce, the size of
    the rank's whole adapter matrices, and no adapter-sized all-reduce besides (under a pipeline once per step, not
    per microbatch; over replicas the bucket spans the tp x dp ranks, of one pipeline rank under a pipeline, so the
    adapters' tp sum and dp mean are that one). Under ``replicate`` the split adapter parts ride in it, each tp rank's
    in its own slot of a zero-padded region, so it averages them over dp too: no second all-reduce. Under ``fsdp``
    the whole matrices are left out of FSDP's sharding and summed so; FSDP reduce-scatters the split parts with the
    base: the step makes the base model's full fine-tune's collectives under the same fsdp layout, kind by kind."""
    modes = ("replicate", "fsdp") if dp > 1 else ("replicate",)
    results = run_on_ranks(lora_workers.trainings, tp * pp * dp, tp, pp, dropout, dp, modes)
    for mode, runs in zip(modes, zip(*(r["runs"] for r in results))):
        for r in runs:
            _trained_exactly(r, tp, pp, dp, mode)
        assert any(r["losses"][0] is not None for r in runs)
    for r in (r for r in results if "pipelines" in r):
        for run in r["pipelines"]:
            _pipeline_at_the_base_models_count(run)
    for r in (r for r in results if "inner_cuts" in r):  # cut inside a layer, frozen embedding: each schedule
        for run in r["inner_cuts"]:
            assert run["worst"] < 1e-5 and run["moved"] > 1e-4 and run["starts"][0].endswith("layers.0.mlp"), run
    for r in (r for r in results if "ia3" in r):  # IA3 and DoRA on all seven projections
        for kind in ("ia3", "dora"):
            got = r[kind]
            assert got["worst"] < 1e-5 and got["moved"] > 1e-3, (kind, got)
            # none smaller than an activation (DoRA's bucket of the stage's adapters is larger): no vector's gradient
            # (IA3's o_proj's, DoRA's row-split magnitudes) summed on its own, no DoRA norm all-reduced on its own
            assert _by_size([("all_reduce", n) for n in got["reduces"]], 2 * 8)[1] == 0, (kind, got)
    for r in (r for r in results if "cast" in r):
        _cast_like_fsdp(r["cast"], r["runs"][modes.index("fsdp")])
        replicated = r["cast"]["replicate"]  # the casts after the GradSum reads: the bucket, no per-layer sum
        assert replicated["kinds"] == r["runs"][modes.index("replicate")]["kinds"], replicated
        _within_bf16(replicated["vs_one"])


BF16_ULP = 2.0 ** -7
"""bfloat16's spacing at 1 (8 bits of significand): a difference of n ulps of a tensor's largest entry is within
``n * BF16_ULP * max|x|``."""


def _cast_like_fsdp(cast: dict, plain: dict) -> None:
    """``lora_cast_workers.fsdp_cast`` under a policy casting FSDP's parameters: the whole matrices stay out of FSDP
    and are cast by autotp as FSDP casts the others, so the step makes the policy-free fsdp step's collectives (one
    bucket all-reduce, none per adapted layer) and computes what FSDP's own treatment of them computes."""
    assert cast["worst"] < 1e-5 and cast["kinds"] == plain["kinds"], (cast, plain)  # float32: exact
    low = cast["bfloat16"]
    assert low["kinds"] == plain["kinds"], low
    # the bucket, summed in the policy's reduction dtype (bfloat16: half the float32 bytes), is the last all-reduce;
    # every other is an activation's, as many as the policy-free step's
    assert low["reduces"][-1] == low["bucket"] // 2 and len(low["reduces"]) == len(plain["reduces"]), low
    assert len(low["sharded_reduces"]) == len(low["reduces"]) - 1 + 2 * len(lora_workers.TARGETS), low
    for name, (diff, largest) in low["vs_sharded"].items():
        # FSDP's treatment (the matrices in its sharding, each share summed where it arrives): the split parts the
        # same bits (the forward is), the whole matrices within the rounding of a bfloat16 sum in another order
        assert diff <= 2 * BF16_ULP * largest and (diff == 0 or _whole(name)), (name, diff, largest)
    _within_bf16(low["vs_one"])


def _within_bf16(differences: dict) -> None:
    """Each adapter weight's step within 8 bfloat16 ulps of its largest entry of one process's step on the bfloat16
    copy (a few roundings apart: the shares, their sum, the sharded matmuls)."""
    for name, (diff, largest) in differences.items():
        assert 0 < largest and diff <= 8 * BF16_ULP * largest, (name, diff, largest)


def _whole(name: str) -> bool:
    """Whether the adapter weight ``name`` is held whole at tp (``A`` on a column-split layer, ``B`` on a row-split
    one: ``test_plan_splits_adapters_like_their_base_layers``)."""
    row = any(f".{layer}." in name for layer in ("o_proj", "down_proj"))
    return ("lora_B" in name) if row else ("lora_A" in name)


@SLOW
def test_interleaved_pipeline_at_the_base_models_count():
    """``interleaved1f1b`` (4 stages of a 4-layer model, 4 microbatches): exact; the pipeline rank whose last
    backward is a later stage's carries the shares in that backward's first input all-reduce, at the base full
    fine-tune's count; the other (its last backward the first stage's, frozen embedding) keeps the bucket."""
    for r in run_on_ranks(lora_workers.pipeline_counts, 4, (("interleaved1f1b", 4),), 4):
        _pipeline_at_the_base_models_count(r[0])


def _pipeline_at_the_base_models_count(r: dict) -> None:
    """One rank's run of ``lora_workers.pipeline_counts``: exact; a step makes the base full fine-tune's
    collectives. On the later stage the adapters' shares ride in the step's last all-reduce (its first layer's input
    gradient in the rank's last backward): no bucket all-reduce of its own. On the first stage (its embedding frozen,
    so one input all-reduce fewer per microbatch than the base's) the bucket stays, one all-reduce."""
    assert r["worst"] < 1e-5, r
    got, base = dict(r["kinds"]), dict(r["base_kinds"])
    reduces, bucket = got.pop("all_reduce"), base.pop("all_reduce")
    assert got == base, r
    if r["first"]:
        assert reduces < bucket and r["reduces"].count(r["bucket"]) == 1, r
    else:
        assert reduces == bucket and r["bucket"] not in r["reduces"], r
        assert r["reduces"][-1] == r["activation"] + r["bucket"], r  # the last carries the shares


def _trained_exactly(r: dict, tp: int, pp: int, dp: int, mode: str) -> None:
    """One rank's ``lora_workers.training`` result under data-parallel ``mode``."""
    assert r["worst"] < 1e-5, (mode, r)
    assert r["moved"] > 1e-4, (mode, r)  # the adapters trained
    assert min(r["norms"]) > lora_workers.CLIP, (mode, r)  # every step clipped
    assert r["frozen_params"] > 0 and r["frozen_grads"] == [] and r["frozen_state"] == [], (mode, r)
    split = r["trained"] - r["bucket"]  # the split adapter parts: each tp rank's in its slot of the bucket
    riders = tp * split if dp > 1 and mode == "replicate" else 0
    carried = pp > 1 and dp == 1 and r["reduces"][-1] - r["bucket"] in r["reduces"]  # a later stage's last
    assert r["bucket"] > 0 and (carried or r["reduces"].count(r["bucket"] + riders) == 1), (mode, r)
    assert lora_workers.RANK * 64 * 4 not in r["reduces"], (mode, r)  # no adapter summed on its own
    assert split not in r["reduces"], (mode, r)  # nor the split parts averaged on their own
    if mode == "fsdp":  # FSDP's all-gathers and reduce-scatters, and all-reduces: the base full fine-tune's
        got, base = dict(r["kinds"]), dict(r["base_kinds"])
        # under a pipeline with replicas the bucket (over tp x dp) is one all-reduce past a later stage's base
        extra = got.pop("all_reduce") - base.pop("all_reduce")
        assert got == base and (extra == 0 if pp == 1 else extra <= 1), (mode, r)
    got = [v for v in r["losses"] if v is not None]
    if dp == 1:  # a replica's loss is its slice's
        assert got == pytest.approx(r["ref_losses"][:len(got)], rel=1e-5, abs=1e-6) if got else True


def test_peft_save_load_merge_and_generate(tmp_path):
    result = run_on_ranks(lora_workers.peft_files, 2, str(tmp_path))[0]
    assert (tmp_path / "ours" / "adapter_config.json").is_file()
    assert (tmp_path / "ours" / "adapter_model.safetensors").is_file()
    for what in ("forward", "saved", "loaded", "merged", "merged_weights"):
        assert result[what] < 1e-5, (what, result)
    assert result["generate"], result


def _split(plan, direction: str, rank: int = 4) -> tuple[list, list]:
    """The plan's collectives in ``direction``: (those of activations, those of the adapters: a weight's gradient,
    of no batch or sequence dim, or a rank-``rank`` value). An ``f`` the base shares with its adapter is listed at
    either reader: the shapes tell them apart."""
    mine = [c for c in plan.collectives if c.direction.value == direction]
    tokens = [c for c in mine if set("BT") & set("".join(c.shape)) and c.shape[-1] != str(rank)]
    return tokens, [c for c in mine if c not in tokens]


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma3"])
def test_zoo_sample_with_lora_on_every_linear_layer(name):
    """Exact, and at the base model's collectives: the base layers' the same forward (a row-split base with a bias,
    GPT-2's ``Conv1D``, too: its adapter's partial sum joins its all-reduce, its bias added once), backward the base's
    activation all-reduces less those the frozen base does not need, plus the one bucket of the adapters' gradient
    shares."""
    import peft
    import torch

    from devtools import zoo

    entry = zoo.entries({name})[0]
    torch.manual_seed(0)
    base = entry.build()
    inputs = entry.inputs(base)
    base_plan = autotp.plan(base, tp=2, example_inputs=inputs, vocab="split")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))
    for key, p in model.named_parameters():
        if "lora_B" in key or key.endswith("bias"):  # GPT-2's biases start at zero: one added twice would not show
            torch.nn.init.normal_(p, std=0.05)
    report = autotp.check(model, tp=2, example_inputs=inputs, vocab="split")
    assert report.exact, str(report)
    forward, adapter_forward = _split(report.plan, "forward")
    backward, adapter_backward = _split(report.plan, "backward")
    assert len(forward) == len(_split(base_plan, "forward")[0])
    # the frozen embedding's gradient is not needed: one activation all-reduce fewer, and one bucket for the adapters
    assert len(backward) + len(adapter_backward) <= len(_split(base_plan, "backward")[0])
    assert [c.operator.value for c in adapter_backward] == ["grad_sum"]
    assert not adapter_forward  # no adapter all-reduced on its own


def test_ia3_split_with_its_base_at_the_base_models_collectives():
    """IA3 on all seven projections (peft's scaling of ``down_proj``'s input, the others' outputs): the vectors split
    with their base layers' features, exact, counted at run time in the checker. Forward: the base model's
    all-reduces. Backward: the base's, less the first (the frozen embedding needs no gradient); a row-split
    layer's output vector (``o_proj``'s) multiplies the all-reduced output, its gradient whole on every rank. Under
    sequence parallelism that vector multiplies this rank's tokens and its share is the bucket's ``[64]``. DoRA:
    ``test_lora_embed.test_dora_split_with_its_base_layers``."""
    import peft
    import torch

    from autotp.checker import prepare
    from tests.lora_checks import checked

    x = models.tokens(2, 8, 1)
    ia3 = peft.get_peft_model(lora_workers.llama(1), peft.IA3Config(target_modules=lora_workers.TARGETS,
                                                                    feedforward_modules=["down_proj"]))
    torch.manual_seed(1)
    for p in (p for p in ia3.parameters() if p.requires_grad):
        torch.nn.init.normal_(p, mean=1.0, std=0.05)
    ia3 = prepare(ia3, (x,))
    _, base_forward, base_backward = checked(lora_workers.llama(1), 2, (x,))
    report, forward, backward = checked(ia3, 2, (x,))
    assert report.exact, str(report)
    at = "base_model.model.model.layers.0."
    assert repr(report.plan.placements[at + "self_attn.k_proj.ia3_l.default"]) == "colwise(dim=0)"
    assert repr(report.plan.placements[at + "mlp.down_proj.ia3_l.default"]) == "colwise(dim=1)"
    assert repr(report.plan.placements[at + "self_attn.o_proj.ia3_l.default"]) == "replicated"
    assert forward == base_forward and backward == base_backward[1:]
    report, forward, backward = checked(ia3, 2, (x,), sequence_parallel=True)
    assert report.exact, str(report)
    assert [op for op, _ in forward] == ["all_gather", "reduce_scatter"] * 2 + ["all_gather"]
    assert backward[-1] == ("all_reduce", (64,)) and all(op != "all_reduce" for op, _ in backward[:-1])


def test_a_hand_written_lora_is_found_from_the_graph_and_a_plain_low_rank_mlp_is_not():
    """Nothing here is peft's: a module adding ``B(A(x))`` to a projection's output is an adapter; two narrow
    projections in a row whose output is not added to a projection's (a low-rank MLP) stay an ordinary region."""
    import torch
    from torch import nn

    class Lora(nn.Module):
        def __init__(self, d_in, d_out, r=4):
            super().__init__()
            self.base, self.a, self.b = nn.Linear(d_in, d_out, bias=False), nn.Linear(d_in, r, False), nn.Linear(r, d_out, False)

        def forward(self, x):
            return self.base(x) + 0.5 * self.b(self.a(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = Lora(32, 64), Lora(64, 32)
            self.low_a, self.low_b = nn.Linear(32, 4, bias=False), nn.Linear(4, 32, bias=False)

        def forward(self, x):
            x = x + self.down(torch.relu(self.up(x)))
            return x + self.low_b(torch.relu(self.low_a(x)))

    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 8, 32)
    report = autotp.check(model, tp=2, example_inputs=(x,))
    assert report.exact, str(report)
    placements = {k: repr(v) for k, v in report.plan.placements.items()}
    assert placements["up.a.weight"] == "replicated" and placements["up.b.weight"] == "colwise(dim=0)"
    assert placements["down.a.weight"] == "rowwise(dim=1)" and placements["down.b.weight"] == "replicated"
    forward = [c for c in report.plan.collectives if c.direction.value == "forward" and "down" in c.module]
    assert len(forward) == 1  # the adapter's partial sum joins the base's one all-reduce
    from autotp.checker import prepare

    adapters = prepare(model, (x,)).captured.analysis.adapters.values()
    assert sorted((a.rank, a.base) for a in adapters) == [(4, "linear"), (4, "linear_3")]  # up.base, down.base


def _at_the_base_models_collectives(name: str, r: dict) -> None:
    """``lora_workers.against_one_process``'s result: exact; forward the base model's collectives; backward its
    activation collectives (less the frozen embedding's, where no trained parameter needs it) and one bucket, or
    the bucket's shares carried in one of those activation all-reduces (``grad_bucket.reduce_with_shares``)."""
    adapted, base = r["adapted"], r["base"]
    assert r["loss"] < 1e-5 and r["worst"] < 1e-5, (name, r)
    assert adapted["forward"] == base["forward"] or (
        len(adapted["forward"]) == len(base["forward"])  # the batch check's few integers may differ in size
        and _by_size(adapted["forward"], 2 * 8) == _by_size(base["forward"], 2 * 8)), (name, adapted, base)
    carried = ["all_reduce", r["activation"] + r["bucket"]]  # the shares riding in an activation's all-reduce
    backward = adapted["backward"]
    if carried in backward:  # after every share arrived (a trained embedding needs the first layer's input grad)
        activations = [["all_reduce", r["activation"]] if e == carried else e for e in backward]
        assert backward.count(carried) == 1 and ["all_reduce", r["bucket"]] not in backward, (name, adapted)
    else:
        *activations, bucket = backward
        assert bucket == ["all_reduce", r["bucket"]], (name, adapted)
    assert r["bucket"] > 0, (name, adapted)
    wide = [e for e in base["backward"] if e[1] == r["activation"]]  # the base's weight gradients are not LoRA's
    # the base's, or all but the one the frozen embedding needs (the first layer's input gradient)
    assert any(activations == wide[:i] + wide[i + 1:] for i in range(len(wide) + 1)), (name, adapted, base)


def test_sequence_parallel_adapters_join_the_base_gather_and_reduce_scatter():
    """Under sequence parallelism, A on a column-split layer reads the base's all-gathered input and a row-split
    layer's adapter partial sum joins the base's reduce-scatter: exact on gloo at tp=2, at the base model's
    collectives (counted at run time), for Llama and for GPT-2 (``Conv1D`` on tokens flattened to ``[B*T, C]``);
    exact in the checker at tp=4 and with dropout (drawn whole for A)."""
    results = run_on_ranks(lora_workers.sequence_parallel, 2)[0]
    for name, result in results.items():
        _at_the_base_models_collectives(name, result)
    # GPT-2's base at Megatron's count, as Llama's nn.Linear layers: per region an all-gather in and a reduce-scatter
    # out forward; backward the reduce-scatter's all-gather, the input's second gather and the gather's reduce-scatter
    for name, r in results.items():
        forward = r["base"]["forward"]
        assert "all_reduce" not in {op for op, _ in forward} and forward.count(["reduce_scatter", 4096]) == 4, forward
    backward = [[e for e in r["base"]["backward"] if e[1] == r["activation"]] for r in results.values()]
    assert backward[0] == backward[1] and backward[0].count(["reduce_scatter", 4096]) == 4, backward
    x = models.tokens(2, 8, 1)
    for tp, dropout in ((4, 0.0), (2, 0.1)):
        report = autotp.check(lora_workers.adapted(dropout), tp=tp, example_inputs=(x,), sequence_parallel=True)
        assert report.exact, str(report)
        base = autotp.plan(lora_workers.llama(), tp=tp, example_inputs=(x,), sequence_parallel=True)
        forward = [c for c in report.plan.collectives if c.direction.value == "forward"]
        assert len(forward) == len([c for c in base.collectives if c.direction.value == "forward"])
        assert [c.operator.value for c in report.plan.collectives].count("grad_sum") == 1


def test_split_parts_ride_the_bucket_each_in_its_slot():
    """``rewrite.bucket_riders``: tp ranks with parts of different sizes (an uneven split) pack them into their own
    slots of one padded region; summed over tp x dp and divided by dp (the bucket's all-reduce), each rank unpacks
    the dp mean of its own parts, and a part without a gradient stays without one."""
    import torch

    from autotp.rewrite.bucket_riders import local_sizes, pack, unpack

    tp, dp = 2, 3
    riders = {0: [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4))],
              1: [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(4))]}
    slot = max(sum(local_sizes(r)) for r in riders.values())
    grads = {(t, d): [torch.randn(3 if t == 0 else 2, 2), None if d == 1 and t == 1 else torch.randn(4)]
             for t in range(tp) for d in range(dp)}
    regions = {k: pack(riders[k[0]], g, slot, k[0], tp, torch.float32) for k, g in grads.items()}
    total = sum(regions.values()) / dp
    for (t, d), g in grads.items():
        mine = [None if x is None else x.clone() for x in g]
        unpack(total, riders[t], mine, slot, t)
        for i, x in enumerate(mine):
            if x is None:
                continue
            held = [grads[(t, e)][i] for e in range(dp)]
            want = sum(h for h in held if h is not None) / dp
            assert torch.allclose(x, want), (t, d, i)
    assert total.numel() == tp * slot
