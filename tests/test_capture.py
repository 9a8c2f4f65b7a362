"""Capture: names kept, sizes recorded, the user's model and process untouched, and the private torch
APIs autotp relies on still where it reads them (these fail loudly, naming the torch version, if not)."""

from __future__ import annotations

import logging
import sys

import sympy
import torch

from autotp import torch_private
from autotp.capture import capture
from autotp.errors import InternalError
from autotp.passes.graph import SHAPE_META, sizes
from tests import models

IDS = models.tokens(2, 16, 0)


def test_symbolic_sizes_are_recorded_as_sympy_expressions():
    cap = capture(models.build("gpt"), (IDS,))
    (ids,) = cap.graph.find_nodes(op="placeholder")
    batch, seq = sizes(ids)
    assert isinstance(batch, sympy.Symbol) and isinstance(seq, sympy.Symbol)
    assert {cap.dim_names[batch.name], cap.dim_names[seq.name]} == {"B", "T"}
    assert all(SHAPE_META in n.meta for n in cap.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))


def test_private_torch_apis_are_where_autotp_reads_them():
    cap = capture(models.build("gpt"), (IDS,))
    assert cap.out_spec is not None
    assert any(torch_private.is_guard_call(n) for n in cap.graph.nodes), (
        f"torch {torch.__version__}: torch.export no longer adds {torch_private.GUARDS_MODULE!r}")
    symbolic = next(n for n in cap.graph.nodes if n.op == "placeholder").meta["val"].shape[0]
    assert isinstance(torch_private.size_expr(symbolic), sympy.Expr)


def test_the_users_autograd_functions_are_recorded_as_they_run_and_apply_is_put_back():
    """``Function.apply`` is a Python classmethod in torch 2.13 and a C descriptor in 2.14: patched and restored
    either way, with the Function computing what it computes unpatched."""
    original, found = torch.autograd.Function.__dict__["apply"], set()
    x = torch.tensor([1.0, -3.0], requires_grad=True)
    with torch_private.applied_functions(found):
        y = models.Square.apply(x)
        torch.nn.functional.relu(y)  # torch's own functions are not the user's
    y.sum().backward()
    assert found == {"tests.models.Square"}
    assert y.tolist() == [1.0, 9.0] and x.grad.tolist() == [2.0, -6.0]
    assert torch.autograd.Function.__dict__["apply"] is original


def test_draft_exports_expression_tracing_is_silenced_and_restored_other_traces_kept():
    """The fallback capture drops draft_export's per-expression tracing (most of its time) and nothing else."""
    from torch.fx.experimental import sym_node

    original, seen = sym_node.dtrace_structured, []
    sym_node.dtrace_structured = lambda name, *args, **kwargs: seen.append(name)
    recorder = sym_node.dtrace_structured
    try:
        with torch_private.expression_tracing_off():
            sym_node.dtrace_structured("expression_created", dict)
            sym_node.dtrace_structured("guard_added", dict)
        assert seen == ["guard_added"]
        assert sym_node.dtrace_structured is recorder
    finally:
        sym_node.dtrace_structured = original


def test_a_changed_private_api_says_which_torch_changed_it():
    class Unknown:
        node = None

    try:
        torch_private.size_expr(Unknown())
    except InternalError as e:
        assert f"torch {torch.__version__} changed" in str(e) and "a bug in autotp" in str(e)
    else:
        raise AssertionError("size_expr accepted a size it cannot read")
    try:
        torch_private.output_spec(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
    except InternalError as e:
        assert "_out_spec" in str(e)
    else:
        raise AssertionError("output_spec accepted a module without one")


def test_capture_leaves_the_process_as_it_found_it(capsys):
    """No process-wide logging switch, no stderr redirect, torch's loggers restored."""
    torch_logger = logging.getLogger("torch._dynamo")
    level = torch_logger.level
    stderr = sys.stderr
    capture(models.build("gpt"), (IDS,))
    assert logging.root.manager.disable == logging.NOTSET
    assert sys.stderr is stderr and torch_logger.level == level


def test_torchs_loggers_are_silent_while_capturing_the_users_are_not_and_all_are_restored():
    """Existing torch loggers disabled, one torch makes while tracing (a module it imports then) silenced through
    ``torch``'s level, the user's own left alone; every flag and level as before afterwards."""
    from autotp.torch_private import quiet_torch_logs

    existing, user = logging.getLogger("torch._autotp_test_existing"), logging.getLogger("autotp_test_user")
    torch_level, user_level = logging.getLogger("torch").level, user.level
    with quiet_torch_logs():
        made_while = logging.getLogger("torch._autotp_test_made_while_tracing")
        assert existing.disabled and not existing.isEnabledFor(logging.CRITICAL)
        assert not made_while.isEnabledFor(logging.CRITICAL)
        assert not user.disabled and user.isEnabledFor(logging.WARNING)
    assert not existing.disabled and not made_while.disabled
    assert logging.getLogger("torch").level == torch_level and user.level == user_level
    assert made_while.isEnabledFor(logging.CRITICAL)


def test_tied_weights_are_read_once_under_their_first_name():
    cap = capture(models.build("gpt"), (IDS,))
    targets = [n.target for n in cap.graph.find_nodes(op="get_attr")]
    assert "model.transformer.wte.weight" in targets and "model.lm_head.weight" not in targets
    assert cap.aliases["lm_head.weight"] == "transformer.wte.weight"


class _KeywordsOnlyLM(torch.nn.Module):
    """A forward that takes ``use_cache`` only through ``**kwargs`` and returns a cache unless told not to."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"use_cache": True})()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, **kwargs):
        out = self.proj(x)
        return out if kwargs.get("use_cache") is False else (out, object())  # a cache torch.export cannot return


def test_a_forward_taking_use_cache_through_kwargs_is_captured_without_its_cache():
    model = _KeywordsOnlyLM()
    captured = capture(model, (torch.randn(2, 3, 8),))
    assert [n.op for n in captured.graph.nodes].count("output") == 1
    assert model.config.use_cache is True  # the user's model untouched


class _PolicyKeywordsOnlyLM(_KeywordsOnlyLM):
    """The same, its config keeping ``use_cache`` two levels down (a policy's language model's text config, PI0's)."""

    def __init__(self):
        super().__init__()
        text = type("TextConfig", (), {"use_cache": True})()
        language = type("LanguageConfig", (), {"sub_configs": {"text_config": object}, "text_config": text})()
        self.config = type("PolicyConfig", (), {"sub_configs": {"vlm_config": object}, "vlm_config": language})()


def test_use_cache_is_passed_where_only_a_nested_sub_config_has_it():
    captured = capture(_PolicyKeywordsOnlyLM(), (torch.randn(2, 3, 8),))
    assert [n.op for n in captured.graph.nodes].count("output") == 1
