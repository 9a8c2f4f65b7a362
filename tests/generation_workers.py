"""Per-rank bodies of the generation tests on gloo: one spawned group checks every model (start-up paid once).

Each model generates greedily from a left-padded batch of prompts of different lengths and is compared with
``model.generate`` on the unsharded model (tokens identical, each step's logits to float32 rounding); sampled
tokens are compared across ranks and with one process's after the same seed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from examples.gpt import build_gpt

VOCAB = 128
NEW = 10
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}


def _small(kind: str, kv_heads: int):
    """A two-layer transformers decoder of ``kind`` with ``kv_heads`` KV heads (4 query heads)."""
    import transformers as T

    torch.manual_seed(0)
    attention = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": kv_heads}
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(intermediate_size=128, **attention))
    if kind == "mistral":  # a window shorter than prompt + new tokens: the window is exercised
        return T.MistralForCausalLM(T.MistralConfig(intermediate_size=128, sliding_window=4, **attention))
    if kind == "gemma2":  # sliding and global layers alternating, soft-capped logits
        return T.Gemma2ForCausalLM(T.Gemma2Config(intermediate_size=128, head_dim=16, sliding_window=4, **attention))
    if kind == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                                    **attention))
    if kind == "gpt2":
        # a vocabulary tp=4 does not divide, split 32 + 32 + 32 + 31 (its logits gathered at full width)
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB - 1, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                              eos_token_id=None, bos_token_id=None))
    raise ValueError(kind)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 6, 4 and 2 tokens, left-padded to 6."""
    ids = torch.randint(0, VOCAB - 1, (3, 6), generator=torch.Generator().manual_seed(1))  # within GPT-2's too
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _same_everywhere(tokens: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tokens) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tokens)
    return all(torch.equal(g, tokens) for g in gathered)


def _compare_hf(kind: str, kv_heads: int, world: int, over_gloo: bool = False, vocab: str = "auto") -> dict:
    """Greedy and sampled generation against transformers' own, over shared memory (the default between the
    processes of one host) or, ``over_gloo``, the parallel module's gloo group (as across hosts)."""
    model = _small(kind, kv_heads).eval()
    ids, mask = _prompts()
    pm = autotp.parallelize(model, tp=world, example_inputs=(ids,), quiet=True, vocab=vocab)
    if over_gloo:
        pm.generation.comm = pm.comm
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                         output_logits=True)
    out = pm.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                      output_logits=True)
    diff = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
    torch.manual_seed(7)
    sampled_ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **SAMPLING)
    pm.manual_seed(7)
    sampled = pm.generate(ids, attention_mask=mask, max_new_tokens=NEW, **SAMPLING)
    mine, whole = pm.generation.cached.cache_bytes(3, 6 + NEW)
    return {"greedy": torch.equal(out.sequences, ref.sequences), "steps": len(out.logits),
            "ref_steps": len(ref.logits), "logit_diff": diff, "sampled": torch.equal(sampled, sampled_ref),
            "same_on_ranks": _same_everywhere(sampled), "cache_bytes": [mine, whole],
            "replicas": sorted({lay.replicas for lay in pm.generation.cached.layouts if lay is not None}),
            "transport": type(pm.generation.comm).__name__,
            "expected_transport": "TorchComm" if over_gloo else "SharedMemoryComm",
            "vocab_split": any(p.kind.value == "vocab" for p in pm.plan.placements.values())}


def _gpt_without_cache(world: int) -> dict:
    """The example GPT (no cache, no attention mask): generation re-runs the sequence; compared with a one-process
    loop doing the same."""
    torch.manual_seed(0)
    model = build_gpt().eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    pm = autotp.parallelize(model, tp=world, example_inputs=(ids,), quiet=True)
    with pytest.warns(UserWarning, match="re-runs the whole sequence"):
        out = pm.generate(ids, max_new_tokens=6, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    pm.manual_seed(3)
    sampled = pm.generate(ids, max_new_tokens=6, do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(3)
    ref = ids
    with torch.no_grad():
        for _ in range(6):
            probs = torch.softmax(model(ref)[:, -1].float(), dim=-1)
            ref = torch.cat([ref, torch.multinomial(probs, 1)], dim=1)
    return {"greedy": torch.equal(out, seq), "sampled": torch.equal(sampled, ref),
            "same_on_ranks": _same_everywhere(sampled), "note": pm.generation.no_cache,
            "plan_note": any(pm.generation.no_cache in n for n in pm.plan.notes)}


def _between_training_steps(world: int) -> dict:
    """Generate, train two steps, generate again: the second generation is the trained model's (no stale copy)."""
    model = _small("llama", 2)
    ids, mask = _prompts()
    pm = autotp.parallelize(model, tp=world, example_inputs=(ids,), quiet=True)
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    before = pm.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    target = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        pm.train()
        pm.step(ids, target=target)
        opt.step()
        opt.zero_grad()
    after = pm.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    trained = _small("llama", 2).eval()
    trained.load_state_dict(pm.full_state_dict())
    ref = trained.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + dist.get_rank()) % VOCAB  # rank 1's prompt differs by one token
    try:
        pm.generate(other, attention_mask=mask, max_new_tokens=NEW)
        refused = ""
    except autotp.InputError as e:
        refused = str(e)
    return {"after": torch.equal(after, ref), "changed": not torch.equal(before, after), "refused": refused}


AT_TWO = ("mistral", "gemma2", "mixtral")
"""The families generated at tp=2. Llama and GPT-2 are generated at tp=4 (``generation_at_four``), and Llama's
KV heads split plainly at tp=2 by Mixtral (its attention and cache) and ``_between_training_steps``: each
model is captured and generated once (the captures are the suite's time)."""


def generation_at_two(rank: int, world: int) -> dict:
    """tp=2: the families of AT_TWO, the example GPT, and training in between."""
    results = {kind: _compare_hf(kind, 2, world) for kind in AT_TWO}
    results["gpt"] = _gpt_without_cache(world)
    results["training"] = _between_training_steps(world)
    return results


def generation_at_four(rank: int, world: int) -> dict:
    """tp=4 above Llama's 2 KV heads (each rank holds the head it shares), and GPT-2 over gloo, its vocabulary of
    127 split unevenly."""
    return {"llama": _compare_hf("llama", 2, world),
            "gpt2": _compare_hf("gpt2", 2, world, over_gloo=True, vocab="split")}

