"""Capture an unmodified nn.Module into a torch.fx graph with parameter and module names kept.

``torch.fx.symbolic_trace`` fails on Hugging Face models in transformers 5.x; ``torch.export`` with
``strict=False`` captures them, keeps ``nn_module_stack`` (so every node maps back to a module) and,
with ``Dim.AUTO`` on the input dimensions ``capture.dynamic`` names (all but an image's height and width),
keeps batch and sequence length dynamic.
"""

from __future__ import annotations

import contextlib
import difflib

import torch
from torch import fx, nn

from autotp.capture.core.capture_failure import raise_capture_failure
from autotp.capture.speedups.computed_once import AUTOCAST_DEVICES, computed_once
from autotp.capture.core.captured import WRAPPER_PREFIX, Captured
from autotp.capture.core.dynamic import dynamic_shapes, fixed_dims, refused_sizes
from autotp.capture.core.examples import (
    ExampleInputs,
    Signature,
    example_inputs_of,
    require_module,
)
from autotp.capture.quirks.grad_modes import inline_no_grad
from autotp.capture.fallbacks.guards import export_taking_example_branches, training_branch_settings
from autotp.capture.core.hidden_gradients import refuse_hidden_gradients
from autotp.capture.quirks.inplace import out_of_place_draws, out_of_place_writes, whole_view_writes
from autotp.capture.quirks.meta_buffers import buffers_on_meta, put_back
from autotp.capture.core.replay import check_gradient_replay, check_replay
from autotp.capture.fallbacks.routed_loops import export_over_routed_experts
from autotp.capture.speedups.speedup_switch import speedups_enabled, tracing_speedups
from autotp.torch_private import (
    applied_functions,
    capturing,
    distribution_checks_off,
    excluded_sizes,
    is_guard_call,
    mutated_args,
    no_cycle_collection,
    plain_sizes,
    quiet_torch_logs,
    sizes_not_fixed_by_probes,
    unchanged_module_casts,
)
from autotp.capture.quirks.low_rank_norms import write_low_rank_norms
from autotp.capture.quirks.weight_norms import expand_weight_norms
from autotp.capture.quirks.weight_writes import data_as_no_grad, read_parameters_past_writes
from autotp.errors import CaptureError, InputError, TrainingSettingError
from autotp.passes.graph import MUTATES_META, SHAPE_META


class _CaptureWrapper(nn.Module):
    """Calls the user's model as the example does (positional, then keyword inputs) plus fixed keyword
    arguments (``use_cache=False``), without touching it. It takes every input flat and positional, so the
    graph's placeholders are the inputs in one fixed order, whatever mix of positional and keyword they were."""

    def __init__(self, model: nn.Module, example: ExampleInputs, fixed_kwargs: dict):
        super().__init__()
        self.model = model  # hence every name the graph holds starts with captured.WRAPPER_PREFIX
        self.positional = len(example.args)
        self.keywords = tuple(name for name, _ in example.kwargs)
        self.fixed_kwargs = fixed_kwargs
        self.sharing: computed_once | None = None  # set while ``_export`` traces: repeated values traced once
        self.speedups = True  # ``capture``'s switch: trace with the speed-ups that keep the graph as it is, or none

    def forward(self, *inputs):  # the graph's placeholders are named after this: inputs_0, inputs_1, ...
        kwargs = dict(zip(self.keywords, inputs[self.positional:]))
        # entered inside the forward: torch.export's tracing hides outer modes from it
        with data_as_no_grad(), self.sharing or contextlib.nullcontext():
            return _without_cache_objects(self.model(*inputs[:self.positional], **kwargs, **self.fixed_kwargs))


def _without_cache_objects(out):
    """The forward's output, each transformers ``Cache`` it returns (a field of its output) set to None: no graph
    returns an object, and a training graph's outputs are its tensors. A model that must build a cache for its own
    use (a block-diffusion decoder reads the keys its encoder wrote) returns it whatever ``use_cache`` says."""
    for name in list(out.keys()) if hasattr(out, "keys") else ():
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(out[name]).__mro__):
            out[name] = None
    return out


def model_kwargs(model: nn.Module) -> dict:
    """Keyword arguments autotp passes to the model's forward (capture and comparisons alike): no KV cache,
    which makes a Hugging Face model traceable. A forward that takes ``use_cache`` only through ``**kwargs``
    gets it when its config (or its text sub-config) has one (such models pass their keyword arguments down to the decoder)."""
    signature = Signature.of(model)
    # a multimodal config keeps use_cache in a sub-config (its text model's, a policy's language model's), which
    # its forward passes the kwargs down to
    takes_it = "use_cache" in signature.keywords or (signature.var_keyword
                                                     and _sets_use_cache(getattr(model, "config", None)))
    return {"use_cache": False} if takes_it else {}


def _sets_use_cache(config, depth: int = 3) -> bool:
    """Whether ``config`` or one of its sub-configs (a few levels down) has ``use_cache``."""
    if config is None or depth == 0:
        return False
    text = getattr(config, "get_text_config", None)
    if hasattr(config, "use_cache") or (callable(text) and hasattr(text(), "use_cache")):
        return True
    subs = (getattr(config, name, None) for name in getattr(type(config), "sub_configs", {}) or {})
    return any(_sets_use_cache(sub, depth - 1) for sub in subs)


def unaliased(inputs: tuple) -> tuple:
    """The example inputs, each tensor its own: one tensor given as two inputs (``labels=input_ids``, the usual
    language-model batch) is traced by export as one value, and the graph would then read either input where the
    model reads the other, silently wrong once a call gives them different values. Later aliases are copied."""
    seen, out = set(), []
    for x in inputs:
        key = (x.untyped_storage().data_ptr(), x.device) if isinstance(x, torch.Tensor) and x.numel() else None
        out.append(x.clone() if key in seen else x)
        if key is not None:
            seen.add(key)
    return tuple(out)


def _export(wrapper: _CaptureWrapper, inputs: tuple, dynamic: bool) -> fx.GraphModule:
    """One torch.export attempt; with ``dynamic`` the input dimensions ``dynamic_shapes`` names are Dim.AUTO.

    A dynamic capture that came out with some of those dimensions fixed, or one of their sizes excluded, is traced
    again with torch's layout probes taking their defaults (``sizes_not_fixed_by_probes``), and the trace that
    leaves the sizes freer wins. A model that slices a buffer or table to the sequence (``mask[:T, :T]`` of a causal
    mask, ``pos[:T]``) is the usual training shape: torch probes the slice's layout (is T the buffer's stride?),
    which at an example as long as the table fixes T there (leaving sequence parallelism nothing to split and the
    module one length to take), and at a shorter one guards T != the table's length (refusing full context)."""
    gm, excluded = _export_once(wrapper, inputs, dynamic)
    bound = fixed_dims(gm, inputs) + len(excluded) if dynamic else 0
    if not bound:
        return gm
    try:
        with sizes_not_fixed_by_probes():
            general, _ = _export_once(wrapper, inputs, dynamic)
    except TimeoutError:  # the caller's time limit
        raise
    except Exception:  # torch.export raises many types; the first trace stands
        return gm
    return general if fixed_dims(general, inputs) + refused_sizes(general, inputs, excluded) < bound else gm


def _export_once(wrapper: _CaptureWrapper, inputs: tuple, dynamic: bool) -> tuple[fx.GraphModule, tuple]:
    """One torch.export trace, and the sizes its input guards exclude one by one (``excluded_sizes``). Attention
    and batched matmuls learn their output sizes from shape-only kernels (``shape_kernels``); a value the forward
    computes again from the same inputs is traced once (``computed_once``), unless the forward wrote into one it
    shared, which is then traced again as the model runs it."""
    for sharing in (computed_once(), None):
        wrapper.sharing = sharing
        try:
            with tracing_speedups(wrapper.speedups):
                program = torch.export.export(wrapper, inputs, strict=False,
                                              dynamic_shapes=dynamic_shapes(inputs) if dynamic else None)
        finally:
            wrapper.sharing = None
        if sharing is None or not sharing.shared_value_written():
            break
    with no_cycle_collection() if wrapper.speedups else contextlib.nullcontext():
        return program.module(), excluded_sizes(program)  # unlifting regenerates the code: as many objects again


def _dim_names(gm: fx.GraphModule) -> dict[str, str]:
    """Name the symbolic input sizes B (first dim of the first input), T (its second), then s0, s1 ..."""
    names: dict[str, str] = {}
    readable = iter(["B", "T"])
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for d in getattr(val, "shape", ()):
            if isinstance(d, torch.SymInt) and str(d) not in names:
                names[str(d)] = next(readable, str(d))
    return names


def _attr_value(gm: fx.GraphModule, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name, None)


def _example_sizes(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """The example's value of every dynamic input size symbol."""
    out: dict[str, int] = {}
    for node, x in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        for d, size in zip(getattr(node.meta.get("val"), "shape", ()), x.shape):
            if isinstance(d, torch.SymInt):
                out.setdefault(str(d), int(size))
    return out


def tensor_aliases(model: nn.Module) -> dict[str, str]:
    """Map every parameter and buffer name of ``model`` to its first name (tied weights share one).

    Parameters come first, so a parameter's first name is also its first name among parameters.
    """
    first: dict[int, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: first.setdefault(id(t), name) for name, t in named}


def _merge_tied_reads(gm: fx.GraphModule, aliases: dict[str, str]) -> None:
    """Make the graph read each tied tensor through one ``get_attr``, named by its first name.

    torch.export may read a tied weight under both names (the embedding through ``lm_head.weight``);
    one read per tensor keeps placements, which are keyed by name, consistent.
    """
    kept: dict[int, fx.Node] = {}
    changed = False
    for node in list(gm.graph.find_nodes(op="get_attr")):
        value = _attr_value(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        name = Captured.param_name(node.target)
        canonical = WRAPPER_PREFIX + aliases.get(name, name)
        if node.target != canonical and _attr_value(gm, canonical) is value:
            node.target, changed = canonical, True
        if id(value) in kept:
            node.replace_all_uses_with(kept[id(value)])
            gm.graph.erase_node(node)
            changed = True
        else:
            kept[id(value)] = node
    if changed:  # the graph's code is regenerated only when it changed (a twentieth of a second at 1,000 nodes)
        gm.recompile()


def _record_facts(gm: fx.GraphModule) -> None:
    """Store what the passes need but only private torch APIs tell: every tensor's sizes (symbolic ones as
    sympy expressions) and the arguments each op writes in place."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta[SHAPE_META] = plain_sizes(val)
        if node.op == "call_function":
            node.meta[MUTATES_META] = mutated_args(node)


_META, _CPU = torch.device("meta"), torch.device("cpu")


def _meta_devices_to_cpu(gm: fx.GraphModule) -> None:
    """A model on the meta device (weights to come from a checkpoint) is traced on meta: the graph then makes
    tensors there (``arange(..., device=meta)`` for positions) and asserts it; the rank modules run on the CPU
    (moved to the GPU as a whole under NCCL), so such arguments say the CPU."""
    def retarget(value):
        return _CPU if isinstance(value, torch.device) and value == _META else value

    for module in gm.modules():  # regions such as autocast-disabled rotary embeddings are submodules
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            args, kwargs = fx.node.map_aggregate(node.args, retarget), fx.node.map_aggregate(node.kwargs, retarget)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            module.recompile()


def _check_inputs_read(gm: fx.GraphModule, example: ExampleInputs, signature: Signature) -> None:
    """Refuse a keyword input that only a ``**kwargs`` took and nothing read: a misspelt name (Hugging Face
    forwards take ``**kwargs``), which would otherwise be ignored without a word."""
    for node, name in zip(gm.graph.find_nodes(op="placeholder"), example.names):
        named = name in signature.keywords or name in signature.positional or name.startswith("args[")
        if not named and all(is_guard_call(user) for user in node.users):
            close = difflib.get_close_matches(name, sorted(signature.keywords), n=1)
            hint = f"did you mean {close[0]}=? " if close else ""
            raise InputError(f"example input {name}= is not a parameter of the model's forward, and nothing in it "
                             f"reads the value (its **kwargs took it); {hint}"
                             f"the forward's inputs are {', '.join(sorted(signature.keywords))}")


@contextlib.contextmanager
def _in_mode(model: nn.Module, training: bool | None):
    """The model in train (or eval) mode for the body, every module's own flag restored afterwards."""
    if training is None:
        yield
        return
    flags = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for module, flag in flags.items():
            module.training = flag


@contextlib.contextmanager
def autocast_off():
    """Autocast off for every device type in the body: a capture made inside the user's ``torch.autocast`` would
    bake its casts into the graph (and a model's ``maybe_autocast`` regions with them), locking the parallel
    module into that autocast; captured without, the graph runs in fp32, or under whatever autocast surrounds
    the parallel module when it runs."""
    with contextlib.ExitStack() as stack:
        for device in AUTOCAST_DEVICES:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def capture(model: nn.Module, example_inputs, training: bool | None = None, *, fallbacks: bool = True,
            speedups: bool | None = None) -> Captured:
    """Capture ``model`` on ``example_inputs`` with torch.export (dynamic sizes, then static), autocast off
    (``autocast_off``): the same graph whether or not the caller is inside ``torch.autocast``.

    ``example_inputs`` is a tensor, a tuple of positional tensors, a dict of keyword tensors, an
    ``ExampleInputs``, or None (token ids are synthesised; see ``capture.examples``). ``training`` captures the
    graph the model runs in train (True) or eval (False) mode; None, the mode it is in. The model is left as
    it was: a wrapper passes ``use_cache=False`` to models that take it, and the modules' modes are restored.
    Without ``fallbacks`` only the dynamic attempt is made (a ``CaptureError`` if it fails: a shortened model
    that ``capture.repeats`` would rather capture in full than try three ways). ``speedups`` False captures without
    the speed-ups that leave the graph as it is (``capture.speedups.speedup_switch``: the same graph, slower);
    None: ``AUTOTP_CAPTURE_SPEEDUPS`` decides.

    The process-wide replacements a capture makes (``autotp.torch_private``) hold its lock: a capture in another
    thread meanwhile waits for this one to end.
    """
    enabled = speedups_enabled(speedups)
    with capturing(), autocast_off():
        return _capture(model, example_inputs, training, fallbacks, enabled)


def _capture(model: nn.Module, example_inputs, training: bool | None, fallbacks: bool, speedups: bool) -> Captured:
    require_module(model)
    example = example_inputs_of(model, example_inputs)
    inputs = unaliased(example.flat)
    wrapper = _CaptureWrapper(model, example, model_kwargs(model))
    wrapper.speedups = speedups
    errors, functions, assumptions = [], set(), ()
    config = getattr(model, "config", None)  # a transformers model's settings, which a refusal may name
    for dynamic in (True, False):
        try:
            with quiet_torch_logs(), _in_mode(model, training), applied_functions(functions), \
                    distribution_checks_off(), unchanged_module_casts(), buffers_on_meta(model) as copies:
                gm = _export(wrapper, inputs, dynamic)
                put_back(gm, copies)
            break
        except TimeoutError:  # the caller's time limit, not a failure to capture: another attempt would outrun it too
            raise
        except Exception as e:  # torch.export raises many unrelated types; all mean "could not capture"
            errors.append((dynamic, e))
            if not fallbacks:
                raise CaptureError(f"could not capture {type(model).__name__} with dynamic sizes: {e}") from e
    else:
        # a loop over the experts a batch routes to: run over every expert the example routes to; other branches
        # on tensor values: taken as the example takes them; both kept as runtime assertions
        try:
            with quiet_torch_logs(), _in_mode(model, training), applied_functions(functions), \
                    distribution_checks_off(), unchanged_module_casts():
                routed = export_over_routed_experts(wrapper, inputs, dynamic_shapes(inputs), errors[-1][1])
                gm, assumptions = routed or export_taking_example_branches(wrapper, inputs, dynamic_shapes(inputs),
                                                                           config)
        except TimeoutError:  # the caller's time limit: no further attempt
            raise
        except CaptureError as e:  # a refusal; one without a setting yields to the plain error's, if that names one
            if isinstance(e, TrainingSettingError) or not training_branch_settings(errors[-1][1], config):
                raise
            gm = None
        except Exception as e:  # the fallback failed too: report the plain capture's error, and the fallback's
            gm, errors = None, errors + [(None, e)]
    if gm is None:
        raise_capture_failure(model, example, errors, training)
    signature = Signature.of(model)
    _check_inputs_read(gm, example, signature)
    inline_no_grad(gm)
    read_parameters_past_writes(gm)
    out_of_place_draws(gm)
    whole_view_writes(gm)
    expand_weight_norms(gm)
    write_low_rank_norms(gm)
    aliases = tensor_aliases(model)
    _merge_tied_reads(gm, aliases)
    _meta_devices_to_cpu(gm)
    _record_facts(gm)
    mode = model.training if training is None else training
    names = {name: Captured.param_name(name) for name, _ in gm.named_parameters()}
    refuse_hidden_gradients(gm, functions, names, mode)
    with _in_mode(model, training):
        check_replay(gm, wrapper, inputs, model)
        if mode:
            try:
                check_gradient_replay(gm, wrapper, inputs, model, functions, names)
            except CaptureError as e:  # a Function's forward wrote in place to what autograd saved: out of place
                if "inplace operation" not in str(e) or not out_of_place_writes(gm):
                    raise
                _record_facts(gm)
                check_replay(gm, wrapper, inputs, model)
                check_gradient_replay(gm, wrapper, inputs, model, functions, names)
    return Captured(module=gm, model_name=type(model).__name__, state_keys=tuple(model.state_dict().keys()),
                    aliases=aliases, dim_names=_dim_names(gm), example_sizes=_example_sizes(gm, inputs),
                    param_names=tuple(n for n, _ in model.named_parameters(remove_duplicate=False)),
                    training=mode, input_names=example.names,
                    signature=signature, custom_functions=tuple(sorted(functions)), assumptions=assumptions)
