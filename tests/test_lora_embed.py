"""LoRA on a vocabulary-split token embedding (peft's ``lora_embedding_A`` / ``_B``): ``A`` split by the vocabulary
like the base table, its lookup's partial sum all-reduced in the base lookup's one all-reduce (``B`` whole);
``modules_to_save`` trained and saved as peft saves it; DoRA split with its base layers. Collectives are counted at
run time in the one-process checker (``tests.lora_checks``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from autotp.checker import prepare
from autotp.mixed_precision import MixedPrecision
from tests import lora_embed_workers, lora_workers, models
from tests.distributed import run_on_ranks
from tests.lora_checks import checked

EMBED = "base_model.model.model.embed_tokens."


@pytest.mark.parametrize("tp", [2, 4])
def test_embedding_adapter_at_the_base_models_collectives(tp):
    """Forward: the base model's collectives, the first all-reduce ``r`` wider (the rank-r lookup beside the
    base's); backward: the base model's (at tp=4 fewer: the base's K/V weights, each held by two ranks, sum their
    gradient shares, which frozen ones need not). With every linear layer adapted too (tp=2), backward: the base
    model's activation all-reduces (the embedding's adapter needs the first layer's input gradient, as the base's
    trained embedding does), the last of them carrying the linear adapters' gradient shares: the base's count.
    Counted at run time in the checker."""
    x = models.tokens(2, 8, 1)
    _, base_forward, base_backward = checked(lora_workers.llama(1), tp, (x,), vocab="split")
    report, forward, backward = checked(lora_workers.adapted(layers=1, targets=["embed_tokens"]), tp, (x,),
                                        vocab="split")
    assert report.exact, str(report)
    assert repr(report.plan.placements[EMBED + "lora_embedding_A.default"]) == "vocab(dim=1)"
    assert repr(report.plan.placements[EMBED + "lora_embedding_B.default"]) == "replicated"
    assert forward[1:] == base_forward[1:]
    assert forward[0] == ("all_reduce", (2, 8, 64 + lora_workers.RANK)) and base_forward[0][-1] == (2, 8, 64)
    assert backward == base_backward[:len(backward)] and (tp == 4 or len(backward) == len(base_backward))
    assert len([c for c in report.plan.collectives if c.direction.value == "forward"]) == len(forward)
    if tp == 4:
        return
    model = lora_workers.adapted(layers=1, targets=[*lora_workers.TARGETS, "embed_tokens"])
    report, forward, backward = checked(model, tp, (x,), vocab="split")
    assert report.exact, str(report)
    assert len(forward) == len(base_forward)
    *activations, last = backward  # the first layer's input all-reduce, carrying every adapter's share
    assert activations == base_backward[:-1] and len(backward) == len(base_backward)
    assert last == ("all_reduce", (2 * 8 * 64 + len(lora_workers.TARGETS) * lora_workers.RANK * 64,))


@pytest.mark.parametrize("vocab,pad,tp,sequence_parallel", [(129, 3, 2, False), (128, None, 2, True),
                                                            pytest.param(131, None, 4, False, marks=pytest.mark.slow)])
def test_embedding_adapter_uneven_vocabulary_padding_and_sequence_parallel(vocab, pad, tp, sequence_parallel):
    """A vocabulary tp does not divide (cut unevenly, ``A`` as its base table), a padding row (no gradient on the
    rank holding it), and a reduce-scatter onto the sequence (both lookups in the one collective)."""
    import peft
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=pad)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name or "lora_embedding" in name:
            torch.nn.init.normal_(p, std=0.05)
    x = models.tokens(2, 8, 1) % vocab
    x[0, :2] = torch.tensor([3, vocab - 1])
    report, forward, _ = checked(model, tp, (x,), vocab="split", sequence_parallel=sequence_parallel)
    assert report.exact, str(report)
    assert repr(report.plan.placements[EMBED + "lora_embedding_A.default"]) == "vocab(dim=1)"
    assert forward[0][1][-1] == 64 + 4  # the two lookups in one collective


def test_embedding_adapter_and_modules_to_save_train_exactly_and_round_trip_peft_files(tmp_path):
    """On gloo at tp=2: AdamW steps of LoRA on every projection and the embedding with the LM head in
    ``modules_to_save``, every parameter as one process has it after the steps, the frozen base without gradients;
    ``save_pretrained`` writes what peft's ``save_pretrained`` writes (its keys and values), ``from_pretrained`` of
    it gives the trained outputs, a peft-saved adapter loads back with peft's outputs and generation, and merges as
    peft merges it.
    DoRA on every projection, split with its base layers, takes the same AdamW steps as one process."""
    result = run_on_ranks(lora_embed_workers.trained_and_saved, 2, str(tmp_path))[0]
    assert result["worst"] < 1e-5 and result["moved"] > 1e-4, result
    assert result["frozen_grads"] == [], result
    assert result["keys"], result
    for what in ("saved_values", "saved", "loaded", "merged", "merged_table"):
        assert result[what] < 1e-5, (what, result)
    assert result["generate"], result
    assert result["dora"]["worst"] < 1e-5 and result["dora"]["moved"] > 1e-4, result  # DoRA's AdamW steps too


def _dora():
    """The one-layer tiny Llama with DoRA on all seven projections, every trained tensor drawn at random."""
    import peft

    model = peft.get_peft_model(lora_workers.llama(1), peft.LoraConfig(r=4, target_modules=lora_workers.TARGETS,
                                                                       use_dora=True))
    torch.manual_seed(1)
    for p in (p for p in model.parameters() if p.requires_grad):
        torch.nn.init.normal_(p, std=0.05)
    return model


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


def test_dora_split_with_its_base_layers():
    """DoRA (``use_dora=True``) split as LoRA is, its magnitude with the base's outputs: exact, at the base model's
    collectives (counted at run time in the checker). A column-split layer's row norms are local; a row-split
    layer's sums of squares over its split inputs ride in the base's one all-reduce (``[out]`` more), and its
    output ``v * (W x + s B A x)`` is scaled after that sum, so its magnitude's gradient is whole on every rank: no
    backward collective. Under sequence parallelism the sums of squares ride in the reduce-scatter (a copy in every
    rank's piece), and the magnitude's gradient share, over this rank's tokens, in the end-of-backward bucket.
    Under bfloat16 autocast (a bfloat16 output beside float32 norms) each is all-reduced on its own."""
    x = models.tokens(2, 8, 1)
    _, base_forward, base_backward = checked(lora_workers.llama(1), 2, (x,))
    dora = prepare(_dora(), (x,))  # captured once for both checks
    report, forward, backward = checked(dora, 2, (x,))
    assert report.exact, str(report)
    at = "base_model.model.model.layers.0."
    placed = {k.removeprefix(at): repr(v) for k, v in report.plan.placements.items() if k.startswith(at)}
    for layer in ("self_attn.q_proj", "mlp.up_proj"):
        assert placed[f"{layer}.base_layer.weight"] == placed[f"{layer}.lora_B.default.weight"] == "colwise(dim=0)"
        assert placed[f"{layer}.lora_magnitude_vector.default.weight"] == "colwise(dim=0)"
        assert placed[f"{layer}.lora_A.default.weight"] == "replicated"
    for layer in ("self_attn.o_proj", "mlp.down_proj"):
        assert placed[f"{layer}.base_layer.weight"] == placed[f"{layer}.lora_A.default.weight"] == "rowwise(dim=1)"
    # each of the base's two all-reduces (o_proj's and down_proj's outputs) carries that layer's [64] sums
    assert [(op, (_numel(shape) + 64,)) for op, shape in base_forward] == forward
    assert len([c for c in report.plan.collectives if c.direction.value == "forward"]) == len(forward)
    *activations, bucket = backward  # the first layer's input needs no gradient: the bucket takes its place
    assert activations == base_backward[1:] and len(backward) == len(base_backward)
    assert bucket[0] == "all_reduce" and len(bucket[1]) == 1

    # sequence parallelism: as plain LoRA (at the base's collectives, ``test_lora``), the reduce-scatters wider
    _, lora_forward, lora_backward = checked(lora_workers.adapted(layers=1), 2, (x,), sequence_parallel=True)
    report, forward, backward = checked(dora, 2, (x,), sequence_parallel=True)
    assert report.exact, str(report)
    widened = [(op, (_numel(shape) + 64,) if op == "reduce_scatter" else shape) for op, shape in lora_forward]
    assert forward == widened
    *activations, bucket = backward
    assert activations == lora_backward[:-1] and bucket[0] == lora_backward[-1][0] == "all_reduce"
    assert bucket[1][0] == lora_backward[-1][1][0] + 2 * 64  # the row-split layers' magnitudes' shares
    # under bfloat16 autocast the output is bfloat16 and the norms float32: each all-reduced on its own, exact
    report, forward, _ = checked(dora, 2, (x,), mixed_precision=MixedPrecision())
    assert report.exact, str(report)
    assert ("all_reduce", (64,)) in forward


@pytest.mark.slow
def test_dora_exact_at_tp_4():
    """Past the 2 KV heads (K/V's DoRA layers held by two ranks per chunk): exact, forward at the base model's
    all-reduces, each ``[out]`` wider, backward at the base's count; with sequence parallelism exact."""
    x = models.tokens(2, 8, 1)
    _, base_forward, base_backward = checked(lora_workers.llama(1), 4, (x,))
    dora = prepare(_dora(), (x,))
    report, forward, backward = checked(dora, 4, (x,))
    assert report.exact, str(report)
    assert [(op, (_numel(shape) + 64,)) for op, shape in base_forward] == forward
    assert len(backward) == len(base_backward)
    report, _, _ = checked(dora, 4, (x,), sequence_parallel=True)
    assert report.exact, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "mistral", "mixtral", "bert:mlm"])
def test_zoo_sample_with_lora_on_every_linear_layer_counted(name):
    """LoRA on every linear layer (``target_modules="all-linear"``) of zoo models beyond Llama, checked at tp=2 and
    counted at run time against the base model: exact; forward at most the base's collectives, backward at most the
    base's count, the adapters' gradient shares in one bucket (the last collective). BERT's adapted head
    transform stays whole as the base's does (its adapter's add is looked through), and its row-split layers with
    a bias carry their adapters in the base's all-reduce."""
    import peft
    import torch

    from devtools import zoo

    entry = zoo.entries({name})[0]
    torch.manual_seed(0)
    base = entry.build()
    inputs = entry.inputs(base)
    _, base_forward, base_backward = checked(base, 2, inputs, vocab="split")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))
    for key, p in model.named_parameters():
        if "lora_B" in key:
            torch.nn.init.normal_(p, std=0.05)
    report, forward, backward = checked(model, 2, inputs, vocab="split")
    assert report.exact, str(report)
    assert len(forward) <= len(base_forward)
    assert len(backward) <= len(base_backward)
    assert [c for c in backward if len(c[1]) == 1 and c[1] not in {s for _, s in base_backward}][-1:] == backward[-1:]


class _HeadTransformed(torch.nn.Module):
    """A token embedding, an MLP block and BERT's head: a transform (dense, GELU, norm) before a vocabulary head."""

    def __init__(self, vocab: int = 128, dim: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.transform, self.norm = torch.nn.Linear(dim, dim), torch.nn.LayerNorm(dim)
        self.decoder = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.decoder(self.norm(torch.nn.functional.gelu(self.transform(h))))


def test_an_adapted_head_transform_stays_whole_as_the_base_keeps_it():
    """LoRA on every linear layer but the vocabulary head (as BERT's ``all-linear``), then on the head too (BERT's
    ``decoder``: its adapter reads the head's input beside it): the head transform the base keeps whole (it feeds
    only the vocabulary-split head) stays whole with its adapter, the head's adapter split as a column-split
    layer's (``A`` whole, ``B`` by the vocabulary), so forward makes the base model's collectives."""
    import peft

    torch.manual_seed(0)
    x = models.tokens(2, 8, 1)
    _, base_forward, base_backward = checked(_HeadTransformed(), 2, (x,), vocab="split")
    for targets in (["up", "down", "transform"], ["up", "down", "transform", "decoder"]):
        model = peft.get_peft_model(_HeadTransformed(), peft.LoraConfig(r=4, target_modules=targets))
        for key, p in model.named_parameters():
            if "lora_B" in key:
                torch.nn.init.normal_(p, std=0.05)
        report, forward, backward = checked(model, 2, (x,), vocab="split")
        assert report.exact, (targets, str(report))
        placed = {k.removeprefix("base_model.model."): repr(v) for k, v in report.plan.placements.items()}
        assert placed["transform.base_layer.weight"] == "replicated", targets
        assert forward == base_forward, targets
        assert len(backward) <= len(base_backward), targets
    assert placed["decoder.lora_A.default.weight"] == "replicated"
    assert placed["decoder.lora_B.default.weight"] == placed["decoder.base_layer.weight"] == "vocab(dim=0)"


def test_lora_on_a_tied_vocabulary_head():
    """LoRA on ``lm_head`` as well as every projection, the head tied to the token embedding: the head's adapter
    split as the vocabulary head is (``B`` by the vocabulary), exact, forward at the base model's collectives and
    backward at most the base's (counted at run time in the checker)."""
    import peft
    import transformers

    config = transformers.LlamaConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    x = models.tokens(2, 8, 1)
    _, base_forward, base_backward = checked(transformers.LlamaForCausalLM(config), 2, (x,), vocab="split")
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=[*lora_workers.TARGETS, "lm_head"]))
    for key, p in model.named_parameters():
        if "lora_B" in key:
            torch.nn.init.normal_(p, std=0.05)
    report, forward, backward = checked(model, 2, (x,), vocab="split")
    assert report.exact, str(report)
    head = "base_model.model.lm_head."
    assert repr(report.plan.placements[head + "lora_B.default.weight"]) == "vocab(dim=0)"
    assert repr(report.plan.placements[head + "lora_A.default.weight"]) == "replicated"
    assert forward == base_forward
    assert len(backward) <= len(base_backward)
