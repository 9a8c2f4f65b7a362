"""Identical blocks captured once and stamped out (``capture.repeats``): the same graph and the same plans as the
full capture, and the full capture wherever identity is not shown."""

from __future__ import annotations

import re

import pytest
import torch
from autotp.capture import capture
from autotp.capture.stamping.repeats import NotRepeated, capture_repeated, repeated_runs, stamp
from autotp.options import Options
from autotp.planning.planner import make_plan
from autotp.tools.model_spec import build_model, parse_overrides, parse_spec

from tests.models import VOCAB, RelativeLM, build, tokens

_HF = {
    "gemma2": ["num_hidden_layers=6"],  # sliding-window and global attention alternate: a unit of two layers
    "deepseek_v3": ["num_hidden_layers=6", "first_k_dense_replace=2"],  # dense blocks, then mixture-of-experts
    "mixtral": ["num_hidden_layers=5"],
    "gemma3_text": ["num_hidden_layers=6"],  # five sliding-window layers, then a global one: no unit repeats 3 times
    "qwen3_moe": ["num_hidden_layers=5"],
}


def _deberta_v2_relative() -> torch.nn.Module:
    """DeBERTa-v3's relative-position attention: each layer casts the encoder's mask (``.to``, which export checks
    with ``_assert_tensor_metadata``) and builds the same c2p/p2c gather indices, all traced once."""
    import transformers

    torch.manual_seed(0)
    config = transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16,
        max_relative_positions=-1, position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True)
    return transformers.DebertaV2ForMaskedLM(config)


def _swin_t_depths() -> torch.nn.Module:
    """Swin-T's stage depths (2, 2, 6, 2), tiny: its blocks alternate plain and shifted windows, so the six-block
    stage repeats a unit of two, each block with its own stochastic-depth rate (the config's default 0.1, rising
    block by block: a constant of each block's training graph, ``capture.block_floats``)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2, 6, 2],
                                     num_heads=[4, 4, 4, 4], window_size=2, num_labels=10)
    return transformers.SwinForImageClassification(config)


def _beit_relative() -> torch.nn.Module:
    """BEiT with a relative-position bias in every layer, whose index table each layer's code builds (a constant
    export lifts per layer) and the default stochastic depth (a rate per layer, the first layer's zero)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BeitConfig(hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
                                     intermediate_size=64, image_size=16, patch_size=4, num_labels=10,
                                     use_relative_position_bias=True)
    return transformers.BeitForImageClassification(config)


def _model(name: str) -> torch.nn.Module:
    if name == "relative":  # each block computes the scale and relative positions the capture traces once
        return RelativeLM(blocks=5, vocab=VOCAB)
    if name == "deberta_v2_relative":
        return _deberta_v2_relative()
    if name == "swin_t_depths":
        return _swin_t_depths()
    if name == "beit_relative":
        return _beit_relative()
    if name in _HF:
        return build_model(parse_spec(f"hf:{name}", parse_overrides(_HF[name])))
    return build(name, layers=5)


def _example(name: str):
    if name in ("swin_t_depths", "beit_relative"):
        size = 32 if name == "swin_t_depths" else 16
        return {"pixel_values": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))}
    return None if name in _HF else tokens(2, 8, seed=0)


def _ops(cap) -> list:
    """Each node: what it does, in which module, at which sizes, with which constants (a constant export lifted
    from the code by what it holds, not by the number export gave it)."""
    return [(n.op, re.sub(r"lifted_tensor_\d+$", "lifted_tensor", str(n.target)), cap.module_name(n),
             repr(n.meta.get("autotp_shape")), _constants(n)) for n in cap.graph.nodes]


def _constants(node: torch.fx.Node) -> tuple:
    leaves, _ = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    return tuple(repr(x) for x in leaves if not isinstance(x, torch.fx.Node))


@pytest.mark.parametrize("name", ["raw_gpt", "hf_llama", "hf_gpt2", "deepseek_v3", "mixtral", "relative",
                                  "deberta_v2_relative", "gemma2", "swin_t_depths", "beit_relative"])
def test_stamped_blocks_make_the_full_capture_graph_and_plans(name):
    model = _model(name)
    full, stamped = capture(model, _example(name)), stamp(model, _example(name))
    assert _ops(stamped) == _ops(full)
    assert (stamped.param_names, stamped.state_keys, stamped.aliases) == (full.param_names, full.state_keys, full.aliases)
    for tp, pp in ((2, 1), (4, 2)):
        options = Options(tp=tp, pp=pp)
        assert make_plan(stamped, options) == make_plan(full, options), (tp, pp)


class _Kind(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.lin = kind, torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).relu() if self.kind == "local" else self.lin(x).tanh()


class _Pattern(torch.nn.Module):
    """Blocks of kinds in the order given: ``"LLG" * 3`` is two local blocks, then a global one, three times."""

    def __init__(self, pattern: str):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Kind("local" if c == "L" else "global") for c in pattern)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("pattern, period, stamped", [
    ("LGLGLGLG", 2, 4), ("LLGLLGLLG", 3, 3), ("GLLGLLGLLG", 3, 3), ("GLLLL", 1, 2), ("LLLLGLLLLG", None, 0),
    ("LGLGLGL", 2, 2)])
def test_a_run_repeats_a_unit_of_blocks_and_the_stamped_graph_is_the_full_one(pattern, period, stamped):
    model, x = _Pattern(pattern), torch.randn(2, 8)
    runs = repeated_runs(model)
    if period is None:  # two repeats of a unit of five: too few to check one unit against another and stamp one
        assert runs == []
        return
    (run,) = runs
    assert run.period == period and len(run.stamped) == stamped and run.keys[-1] == str(len(pattern) - 1)
    assert len(run.keys) % period == 0 and all(len(unit) == period for unit in run.units)
    full, made = capture(model, (x,)), stamp(model, (x,))
    assert _ops(made) == _ops(full)
    assert torch.equal(_output(made, x), model(x))


def _output(made, x) -> torch.Tensor:
    """The captured module's output on ``x`` (its first, where it returns a tuple)."""
    out = made.module(x)
    return out[0] if isinstance(out, tuple) else out


def test_blocks_in_a_sequential_are_stamped_as_a_lists_are():
    """timm's and torchvision's vision transformers keep their blocks in an ``nn.Sequential``."""
    x = torch.randn(2, 8)
    assert repeated_runs(torch.nn.Sequential(*(_Kind("local") for _ in range(5)), torch.nn.Linear(8, 4))) == []
    stacked = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(*(_Kind("local") for _ in range(5))))
    (run,) = repeated_runs(stacked)
    assert run.path == "1" and run.keys == ("0", "1", "2", "3", "4") and run.stamped == ("2", "3", "4")
    made = stamp(stacked, (x,))
    assert _ops(made) == _ops(capture(stacked, (x,)))
    assert torch.equal(_output(made, x), stacked(x))


def test_runs_are_the_identical_blocks_that_end_each_list():
    (run,) = repeated_runs(_model("deepseek_v3"))
    assert run.path == "model.layers" and run.keys == ("2", "3", "4", "5") and run.stamped == ("4", "5")
    assert repeated_runs(_model("gemma3_text")) == []  # the last block (full attention) is alone in its run
    assert repeated_runs(build("hf_llama", layers=2)) == []  # two blocks are both captured anyway


def test_a_block_whose_graph_depends_on_its_index_falls_back_to_the_full_capture():
    class Block(torch.nn.Module):
        def __init__(self, index: int):
            super().__init__()
            self.index = index
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) * (self.index + 1)  # the same signature (its index), another constant per block

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(i) for i in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model, x = Stack(), torch.randn(2, 8)
    assert repeated_runs(model)  # the signatures agree: only the graphs tell the blocks apart
    with pytest.raises(NotRepeated):
        stamp(model, x)
    stamped = capture_repeated(model, x)
    assert _ops(stamped) == _ops(capture(model, x))
    assert [str(n.args[1]) for n in stamped.graph.nodes if n.target is torch.ops.aten.mul.Tensor] == ["1", "2", "3", "4"]
