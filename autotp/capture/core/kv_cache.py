"""Generation's capture: a decoder whose KV cache is explicit graph inputs, written in place.

A Hugging Face decoder keeps its cache in a ``Cache`` object that no graph can take as an input. ``CachedStep``
calls the model with a tiny ``Cache`` whose per-layer keys and values are tensors handed in as graph inputs, each
``[batch, kv_heads, length, head_dim]`` and written with ``index_copy_`` at the new tokens' positions (as
transformers' ``StaticCache`` does, and its executorch export keeps in place). torch.export keeps that write on
the input, so the graph's own ops say where the cache lives: propagation places each cache tensor as the K/V
values written into it are placed (``rewrite.cache_layout``). Every size stays dynamic (batch, cache length).

The cache is as long as the whole generation; the attention reads all of it under a mask built from positions,
so a sliding-window layer attends exactly the window it attends with Hugging Face's own caches (the mask says
which keys, not the storage), and a step costs the same at every position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autotp.capture.core.captured import Captured
from autotp.capture.core.export import capture
from autotp.capture.core.examples import Signature
from autotp.torch_private import is_guard_call
from autotp.errors import CaptureError

#: Layer kinds whose cache is a plain key/value store readable under a position mask (transformers' names).
_SUPPORTED_LAYERS = ("full_attention", "sliding_attention")

#: The forward keyword a decoder takes its cache by, newest first (transformers 5.24 renamed past_key_values to
#: cache, and its outputs' attribute likewise): read from each model's signature, never from a version number.
CACHE_NAMES = ("cache", "past_key_values")

STEP_EXAMPLE = (2, 5, 11)
"""Batch, token count and cache length the step graph is captured with (distinct, so none is specialised)."""


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache tensors (whole): KV heads, key and value head sizes, dtype."""

    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class CacheShape:
    """Every cached layer's tensors, in the order the graph takes them (keys then values, layer by layer)."""

    layers: tuple[LayerCache, ...]

    def tensors(self, batch: int, length: int, device=None) -> list[torch.Tensor]:
        """Empty (zero) whole cache tensors for ``batch`` sequences of up to ``length`` tokens."""
        out = []
        for layer in self.layers:
            for dim in (layer.key_dim, layer.value_dim):
                out.append(torch.zeros(batch, layer.heads, length, dim, dtype=layer.dtype, device=device))
        return out


def cache_keyword(signature: Signature) -> str | None:
    """The keyword ``signature``'s forward takes a KV cache by (``cache`` or ``past_key_values``); None if neither."""
    return next((name for name in CACHE_NAMES if name in signature.keywords), None)


def output_cache(out):
    """The cache a model's output returns (its ``cache`` or ``past_key_values`` field); None if it has neither.
    Read as fields, not attributes: 5.24's outputs keep ``past_key_values`` as a property that warns."""
    fields = out.keys() if hasattr(out, "keys") else ()
    return next((out[name] for name in CACHE_NAMES if name in fields), None)


def _cache_classes():
    """transformers' cache base classes (imported only for models that have a cache: it is optional)."""
    from transformers.cache_utils import Cache, CacheLayerMixin
    return Cache, CacheLayerMixin


def _tensor_cache(keys_values: tuple[torch.Tensor, ...], offset: torch.Tensor, sliding: tuple[bool, ...]):
    """A transformers ``Cache`` over the given tensors; ``offset`` (a 0-d tensor) is where the new tokens go."""
    Cache, CacheLayerMixin = _cache_classes()

    class TensorLayer(CacheLayerMixin):
        is_compileable = True  # a fixed-size cache: the mask is always built, never skipped for a plain causal one

        def __init__(self, keys, values, is_sliding):
            super().__init__()
            self.keys, self.values, self.is_sliding, self.is_initialized = keys, values, is_sliding, True

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            positions = torch.arange(key_states.shape[-2], device=key_states.device) + offset
            self.keys.index_copy_(2, positions, key_states)  # in place: the caller's tensor is the cache
            self.values.index_copy_(2, positions, value_states)
            return self.keys, self.values

        def get_mask_sizes(self, query_length):
            return self.keys.shape[2], 0  # every slot; the mask hides the unwritten ones and the window

        def get_seq_length(self):
            return offset

        def get_max_length(self):
            return self.keys.shape[2]

    layers = [TensorLayer(keys_values[2 * i], keys_values[2 * i + 1], s) for i, s in enumerate(sliding)]
    return Cache(layers=layers)


class CachedStep(nn.Module):
    """Calls ``model`` on (ids, attention mask over the cache, position ids, offset, cache tensors...) and returns
    the last position's logits ``[batch, 1, vocab]``. It holds the model's children, so its parameters have the
    model's names; the model itself is kept out of the module tree."""

    def __init__(self, model: nn.Module, sliding: tuple[bool, ...]):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b)
        object.__setattr__(self, "_target", model)
        self.sliding = sliding
        signature = Signature.of(model)
        self.keep_last = "logits_to_keep" in signature.keywords
        self.cache_keyword = cache_keyword(signature)

    def forward(self, *inputs):
        ids, mask, positions, offset, *keys_values = inputs
        extra = {"logits_to_keep": 1} if self.keep_last else {}
        extra[self.cache_keyword] = _tensor_cache(tuple(keys_values), offset, self.sliding)
        out = self._target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[:, -1:]


def why_no_cache(model: nn.Module) -> str:
    """'' when ``model`` can be captured with a tensor cache; else why not (a plan note: generation re-runs)."""
    signature = Signature.of(model)
    if cache_keyword(signature) is None or "position_ids" not in signature.keywords:
        return (f"{type(model).__name__}.forward takes no cache (or past_key_values) and position_ids (no KV "
                "cache): generate re-runs the whole sequence for every token; add a cache (as transformers' "
                "decoders take one) to decode at a cost independent of the position")
    config = getattr(model, "config", None)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        kinds, _ = get_layer_types_and_kwargs(config)
    except Exception as e:  # no transformers, or a config it cannot read: no cache graph
        return f"the cache layers of {type(model).__name__} could not be read from its config ({type(e).__name__})"
    other = sorted(set(kinds) - set(_SUPPORTED_LAYERS))
    if other:
        return (f"{type(model).__name__} has cache layers of kind {', '.join(other)} (not a key/value store read "
                "under a position mask: recurrent or compressed state): generate re-runs the whole sequence for "
                "every token, which is exact but costs more per token as the sequence grows")
    return ""


PIPELINE_NOTE = ("generation needs pp=1: a decode step would pass one token through every pipeline stage in turn, "
                 "so a pipelined module refuses generate; plan with pp=1 (tp = tp x pp fits the same ranks) to "
                 "generate")
"""The plan note of a pp > 1 plan of a model with an LM head, and the text of ``PipelineModule.generate``'s refusal."""


def generation_notes(model: nn.Module, has_lm_head: bool, pp: int) -> tuple[str, ...]:
    """What a plan says about ``pm.generate`` (none for a model with no LM head: it does not generate tokens): that
    a pipeline refuses it, or that a model with no KV cache re-runs the whole sequence for every token."""
    if not has_lm_head:
        return ()
    if pp > 1:
        return (PIPELINE_NOTE,)
    why = why_no_cache(model)
    return (f"generate: {why}",) if why else ()


def layer_kinds(model: nn.Module) -> tuple[bool, ...]:
    """Whether each layer's attention is a sliding window (from the config, as transformers' caches tell)."""
    from transformers.cache_utils import get_layer_types_and_kwargs
    kinds, _ = get_layer_types_and_kwargs(model.config)
    return tuple(kind == "sliding_attention" for kind in kinds)


def cache_shape(model: nn.Module) -> CacheShape:
    """Each layer's cache tensors, read from one token run through the model with its own cache (on the meta
    device for a model without weights)."""
    device = next(iter(model.parameters())).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    except Exception as e:  # models raise many types (a kernel refusing the meta device): no cache graph
        first = (str(e).strip().splitlines() or [""])[0]
        raise CaptureError(f"{type(model).__name__} did not run one token with its own cache on {device} to size "
                           f"the cache ({type(e).__name__}: {first})") from e
    cache = output_cache(out)
    if cache is None or not hasattr(cache, "layers"):
        raise CaptureError(f"{type(model).__name__} ran one token with use_cache=True but returned no cache of "
                           f"layers (its output has {', '.join(out.keys()) if hasattr(out, 'keys') else type(out)})")
    layers = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        layers.append(LayerCache(int(k.shape[1]), int(k.shape[-1]), int(v.shape[-1]), k.dtype))
    return CacheShape(tuple(layers))


FIRST_CACHE_INPUT = 4
"""Where the cache tensors start among a step's inputs (after ids, mask, positions and offset)."""


def step_inputs(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, offset: int,
                cache: list[torch.Tensor]) -> tuple:
    """The inputs of a ``CachedStep`` graph, in order (the cache from ``FIRST_CACHE_INPUT`` on)."""
    return (ids, mask, positions, torch.tensor(offset, dtype=torch.long), *cache)


def capture_step(model: nn.Module, shape: CacheShape) -> Captured:
    """The eval-mode generation step of ``model`` with its cache as inputs: one graph for the prompt (prefill) and
    for each new token (decode), batch, token count and cache length all dynamic.

    One capture serves both. It is traced on several tokens, so the token count stays a symbol; run on one token
    it computes what a graph captured on one token computes, bit for bit (every op takes its sizes from its
    inputs: checked on Llama, Mistral, Gemma 2 and Mixtral, and by the generation tests against
    ``model.generate``). A second capture on one token cost more than the first (export fixes that size, and the
    capture is then traced again to try to free it): about 60% of generation's set-up."""
    step = CachedStep(model, layer_kinds(model))
    device = next(iter(model.parameters())).device
    batch, tokens, length = STEP_EXAMPLE
    ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device).expand(batch, tokens)
    example = step_inputs(ids, mask, positions, 0, shape.tensors(batch, length, device))
    return _without_guards(capture(step, example, training=False))


def _without_guards(captured: Captured) -> Captured:
    """The step without export's input-shape guard: each rank is given its split of the cache, not the whole
    shapes the guard checks (the runtime makes the cache itself, of the shapes the graph takes)."""
    for node in list(captured.graph.nodes):
        if is_guard_call(node) and not node.users:
            captured.graph.erase_node(node)
    captured.module.recompile()
    return captured
