"""Generation on a tensor-parallel module: ``pm.generate`` with a sharded KV cache, or by re-running.

A model with a cache (a transformers decoder) gets one more rank graph, captured once: a step taking any number
of tokens (the prompt, then one new token at a time) and the cache tensors as inputs, writing the new keys and
values into them in place (``capture.kv_cache``). Each rank holds only its split of the cache
(``rewrite.cache_layout``) and the graph reads the training module's own tensors, so generation between training
steps uses the current weights with no copy. A model without a cache re-runs its eval graph on the whole sequence
for every token (exact, slower), and says so.

The loop is Hugging Face's: left-padded prompts get positions from the attention mask's cumulative sum, finished
sequences are filled with ``pad_token_id``, and sampled tokens are taken from the first rank so that every rank
continues the same sequences whatever the floating point does.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from autotp.capture import Captured
from autotp.capture.core.kv_cache import step_inputs, why_no_cache
from autotp.errors import CaptureError, InputError
from autotp.passes.placement import local_shape
from autotp.rewrite.comm import Communicator
from autotp.runtime.batch_agreement import check_same_inputs
from autotp.runtime.sampling import Settings, choose, resolve
from autotp.runtime.shared_memory import SharedMemoryComm, same_host

BuildSteps = Callable
"""``rewrite.cache_layout.build_cache_steps(model, plan, rank, comm, tensors) -> CacheSteps`` (its ``shape``,
``layouts`` and ``step``), given by ``autotp.api``: the runtime runs graphs, building them is the rewrite's."""


class CachedGenerator:
    """A rank's generation step (prefill and decode alike) over its split of the KV cache (built by the rewrite's
    ``cache_layout.build_cache_steps``, reading a parallel module's tensors)."""

    def __init__(self, built, tp: int):
        self.shape, self.layouts, self.step, self.tp = built.shape, built.layouts, built.step, tp

    def cache(self, batch: int, length: int, device) -> list[torch.Tensor]:
        """This rank's empty cache tensors (its split of each) for ``batch`` sequences of ``length`` tokens."""
        whole = self.shape.tensors(batch, length, "meta")
        return [torch.zeros(local_shape(tuple(t.shape), lay, self.tp), dtype=t.dtype, device=device)
                for t, lay in zip(whole, self.layouts)]

    def cache_bytes(self, batch: int, length: int) -> tuple[int, int]:
        """(this rank's cache bytes, the whole cache's bytes) for ``batch`` x ``length``."""
        whole = self.shape.tensors(batch, length, "meta")
        mine = sum(torch.Size(local_shape(tuple(t.shape), lay, self.tp)).numel() * t.element_size()
                   for t, lay in zip(whole, self.layouts))
        return mine, sum(t.numel() * t.element_size() for t in whole)

    def run(self, ids: torch.Tensor, mask: torch.Tensor, s: Settings, pick, seen: list | None = None) -> torch.Tensor:
        """The generated sequences (prompt and new tokens, as ``model.generate`` returns them)."""
        batch, prompt = ids.shape
        length = prompt + s.max_new_tokens
        full = torch.zeros(batch, length, dtype=mask.dtype, device=mask.device)
        full[:, :prompt] = mask
        cache = self.cache(batch, length, ids.device)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as transformers numbers padding
        logits = self.step(*step_inputs(ids, full, positions, 0, cache))
        return _loop(ids, logits[:, -1], s, pick, lambda tokens, t: self._decode(tokens, full, cache, t), seen)

    def _decode(self, tokens: torch.Tensor, full: torch.Tensor, cache, t: int) -> torch.Tensor:
        full[:, t] = 1  # transformers extends the mask with ones, finished sequences too
        positions = full[:, :t + 1].long().sum(-1, keepdim=True) - 1  # the last position + 1, as transformers
        return self.step(*step_inputs(tokens[:, None], full, positions, t, cache))[:, -1]


@dataclass
class GenerateOutput:
    """What ``generate(..., return_dict_in_generate=True, output_logits=True)`` returns, as transformers names it."""

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...] | None = None
    """Each step's logits ``[batch, vocab]`` before any processing (with ``output_logits``)."""


def _loop(ids: torch.Tensor, last: torch.Tensor, s: Settings, pick, step, seen: list | None = None) -> torch.Tensor:
    """transformers' decoding loop: choose, pad finished sequences, stop at EOS or ``max_new_tokens``; ``seen``
    collects each step's logits."""
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    eos = torch.tensor(s.eos, dtype=ids.dtype, device=ids.device) if s.eos else None
    out = [ids]
    prompt = ids.shape[1]
    for i in range(s.max_new_tokens):
        if seen is not None:
            seen.append(last.clone())
        tokens = pick(last)
        if eos is not None:
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, s.pad))
            unfinished &= ~torch.isin(tokens, eos)
        out.append(tokens[:, None])
        if i + 1 == s.max_new_tokens or not bool(unfinished.any()):
            break
        last = step(tokens, prompt + i)
    return torch.cat(out, dim=1)


def rerun(forward, takes_mask: bool, ids: torch.Tensor, mask: torch.Tensor, s: Settings, pick,
          seen: list | None = None) -> torch.Tensor:
    """Generation by re-running the whole sequence for every token (a model with no cache)."""
    if not takes_mask and not bool(mask.all()):
        raise InputError("this model was captured without an attention_mask, so it cannot skip padding: pass "
                         "prompts of one length (no padding), or capture it with attention_mask among example_inputs")
    state = {"ids": ids, "mask": mask}

    def logits_of() -> torch.Tensor:
        kwargs = {"attention_mask": state["mask"]} if takes_mask else {}
        out = forward(state["ids"], **kwargs)
        logits = getattr(out, "logits", out)
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        return logits[:, -1]

    def step(tokens: torch.Tensor, t: int) -> torch.Tensor:
        state["ids"] = torch.cat([state["ids"], tokens[:, None]], dim=1)
        state["mask"] = torch.cat([state["mask"], torch.ones_like(state["mask"][:, :1])], dim=1)
        return logits_of()

    return _loop(ids, logits_of(), s, pick, step, seen)


def picker(s: Settings, generator: torch.Generator | None, comm: Communicator | None):
    """The function choosing next tokens: argmax, or a draw taken from the first rank (ranks agree always)."""
    def pick(last: torch.Tensor) -> torch.Tensor:
        tokens = choose(last, s, generator)
        if s.do_sample and comm is not None and comm.size > 1:
            tokens = comm.all_gather(tokens)[0].to(tokens.dtype)
        return tokens
    return pick


def prompt_of(input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt ids and their mask, checked (2-D integer ids, a mask of the same shape, left padding)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = f"shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise InputError(f"input_ids must be a 2-D integer tensor [batch, prompt length], got {got}")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise InputError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {got}")
    if not bool(attention_mask[:, -1].all()):
        raise InputError("attention_mask has padding at the end of a prompt; generation continues each prompt "
                         "from its last token, so pad on the left (tokenizer.padding_side = 'left')")
    return input_ids, attention_mask.to(torch.long)


class Generation:
    """What ``ParallelModule.generate`` needs besides the rank graphs: the model's structure (captured again for the
    generation steps, its weights never copied) and the random stream of sampling (the generation_config is the
    parallel module's own, ``pm.generation_config``)."""

    def __init__(self, model: nn.Module, build_steps: BuildSteps):
        self._build_steps = build_steps
        self.no_cache = why_no_cache(model)
        # The parallel module must not keep the user's weights alive (the steps read its own shards): a model with
        # weights is held weakly until the first generate captures its steps; one on the meta device costs nothing.
        meta = all(t.is_meta for t in model.parameters())
        self._held = model if meta and not self.no_cache else None
        self._model = weakref.ref(model)
        self.generator: torch.Generator | None = None
        self.cached: CachedGenerator | None = None
        self._comm: Communicator | None = None
        self._own_comm = False  # made here (same_host), so closed here
        self.warned = False

    @property
    def comm(self) -> Communicator | None:
        """What the generation step and the sampled tokens' agreement talk over, chosen when the step is built
        unless set before: shared memory between the CPU processes of one host (``runtime.shared_memory.same_host``:
        a decode step's collectives are a few KB, and gloo's loopback round trip and wake-up cost more than a
        layer's compute), else the parallel module's own communicator. Set after the step is built (parallelize
        builds it ahead for an eval-mode model), the step is built again over the new one at the next generate:
        its collectives are those of the communicator it was built with."""
        return self._comm

    @comm.setter
    def comm(self, comm: Communicator | None) -> None:
        if comm is self._comm:
            return
        self._close_own()
        self._comm, self.cached = comm, None

    def _close_own(self) -> None:
        if self._own_comm and isinstance(self._comm, SharedMemoryComm):
            self._comm.close()
        self._own_comm = False

    def close(self) -> None:
        """Release the shared memory the generation steps talk over (with the parallel module's groups)."""
        if isinstance(self._comm, SharedMemoryComm):
            self._comm.close()

    def manual_seed(self, seed: int) -> None:
        """Draw samples from ``seed`` on: the tokens one process samples after ``torch.manual_seed(seed)``."""
        self.generator = torch.Generator().manual_seed(seed)

    def generate(self, pm, input_ids, attention_mask, given: dict) -> torch.Tensor:
        """``pm.generate``: see ``ParallelModule.generate``."""
        if pm.fsdp_unit is not None:
            raise InputError("generate runs the tensor-parallel graphs on whole parameters; under dp_mode='fsdp' "
                             "they are sharded over the replicas: use dp_mode='replicate' (or dp=1) to generate")
        as_dict, output_logits = given.pop("return_dict_in_generate"), given.pop("output_logits")
        config = given.pop("generation_config", None)
        settings = resolve(config if config is not None else pm.generation_config, given)
        ids, mask = prompt_of(input_ids, attention_mask)
        seen = [] if output_logits else None
        if not self.no_cache:
            self._build(pm)
        elif not self.warned:  # once per module: what it costs, and what to add
            warnings.warn(f"autotp generate: {self.no_cache}", stacklevel=3)
            self.warned = True
        # Ranks given different prompts would each decode a mixture of both; one all-gather of their
        # fingerprints, over what the steps talk over, refuses that on every rank, as a training forward does.
        check_same_inputs(("input_ids", "attention_mask"), (ids, mask), self.comm or pm.comm)
        pick = picker(settings, self.generator, self.comm or pm.comm)
        with torch.inference_mode():
            if self.no_cache:
                spec = pm._inputs
                with pm.precision_autocast():  # as the module's forward runs (a cast-down module, a policy)
                    out = rerun(lambda x, **kw: spec.run(pm.eval_module, (x,), kw), _accepts_mask(spec),
                                ids, mask, settings, pick, seen)
            else:
                out = self.cached.run(ids, mask, settings, pick, seen)
        return GenerateOutput(out, tuple(seen) if seen is not None else None) if as_dict else out

    def prepare(self, pm) -> None:
        """Build the cached steps now (``pm.prepare_generation``)."""
        if not self.no_cache:
            self._build(pm)

    def _build(self, pm) -> None:
        """The cached steps, once; a model whose cached step cannot be captured re-runs instead, saying why."""
        if self.cached is not None:
            return
        model = self._held or self._model()
        if model is None:
            raise InputError("generate captures its step from the model on its first call, and "
                             "the model passed to parallelize has been freed since; call pm.generate once (e.g. "
                             "max_new_tokens=1) before dropping the model, or keep it")
        if self._comm is None:
            self._comm, self._own_comm = same_host(pm.comm), True
        try:
            built = self._build_steps(model, pm.plan, pm.rank, self.comm, rank_tensors(pm))
            self.cached = CachedGenerator(built, pm.plan.tp)
            self._held = None
        except CaptureError as e:
            self.no_cache = (f"its forward could not be captured with a KV cache as graph inputs ({e}); generate "
                             "re-runs the whole sequence for every token (exact, slower)")
            warnings.warn(f"autotp generate: {self.no_cache}", stacklevel=3)
            self.warned = True


def for_generation(model: nn.Module, input_names: tuple[str, ...], generates: bool) -> bool:
    """Whether ``parallelize`` captures the generation step ahead (``pm.prepare_generation``), so that the first
    ``generate`` captures nothing: a model that ``generates`` (tensor parallel, whole parameters), in eval mode
    (as ``from_pretrained`` returns it, or as one calls ``.eval()`` to serve), captured with no ``labels`` (no
    loss: the inference shape) and with a KV cache (one without re-runs its eval graph, with nothing to capture).
    A training user's model is in train mode, or is captured with its labels; one that is neither (an eval-mode
    model trained through ``pm.step(target=...)``) pays one more capture at set-up, as it would at a first
    ``generate``."""
    return generates and not model.training and "labels" not in input_names and not why_no_cache(model)


def _accepts_mask(spec) -> bool:
    """Whether the parallel module was captured with an attention_mask input."""
    return "attention_mask" in getattr(spec, "names", ())


def rank_tensors(pm) -> dict[str, torch.Tensor]:
    """The parallel module's tensors (this rank's shards) under the original names."""
    out = {}
    for gm in (pm.module, pm.eval_module):
        for target, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
            if not target.startswith("autotp_"):
                out.setdefault(Captured.param_name(target), t)
    return out
