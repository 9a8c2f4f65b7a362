"""Per-rank bodies of the drop-in model tests on gloo: ``pm`` answers like the Hugging Face model it was made from
(``config``, ``state_dict``/``load_state_dict``, ``save_pretrained``, an evaluation forward without labels, generate's
arguments), each checked against the unsharded model."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import autotp
from autotp.errors import CheckpointError, InputError

VOCAB = 128
ADAM = dict(lr=1e-2, eps=1e-3)  # an eps above the gradients' rounding: Adam does not blow float noise up to lr


def small_llama():
    """A two-layer Llama (4 query heads, 2 KV heads), seeded."""
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


def _ids(seed: int, batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _worst(full: dict, ref: dict) -> float:
    return max(float((full[k] - v).abs().max()) for k, v in ref.items())


def _error(call) -> str:
    try:
        call()
    except (InputError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _pieces(state: dict, full: dict) -> dict:
    """Per key: whether this rank's tensors over the ranks make up the full tensor exactly once (the shards of a
    split parameter side by side, a replicated one whole on each rank)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: v.clone() for k, v in state.items()})
    out = {}
    for key, whole in full.items():
        parts = [s[key] for s in every]
        if all(p.shape == whole.shape for p in parts):
            out[key] = all(torch.equal(p, whole) for p in parts)
        else:
            dim = next(d for d in range(whole.dim()) if parts[0].shape[d] != whole.shape[d])
            out[key] = torch.equal(torch.cat(parts, dim), whole)
    return out


def state_dicts(pm, ref) -> dict:
    """``state_dict`` under the original keys, ``load_state_dict`` of a full and of a local state dict, and
    training after a load, against ``ref`` (the unsharded model, changed here)."""
    out = {}
    mine, original = copy.deepcopy(pm.state_dict()), copy.deepcopy(ref.state_dict())
    out["keys"] = list(mine) == list(original)
    out["pieces"] = all(_pieces(mine, original).values())
    out["shard_smaller"] = sum(v.numel() for v in mine.values()) < sum(v.numel() for v in original.values())
    out["no_mangled"] = not any(k.startswith(("module.", "eval_module.")) for k in mine)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9).add_(0.01)
    result = pm.load_state_dict(ref.state_dict())
    out["full_loaded"] = _worst(pm.full_state_dict(), ref.state_dict())
    out["nothing_left"] = list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    ids = _ids(3)
    pm.eval(), ref.eval()
    out["output_after_load"] = float((pm(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())
    pm.train(), ref.train()
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(2):
        batch = {"input_ids": _ids(10 + step), "labels": _ids(20 + step)}
        pm.step(**batch)
        ref(**batch).loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    out["params_after_steps"] = _worst(pm.full_state_dict(), ref.state_dict())
    pm.load_state_dict(mine)  # this layout's own state dict back
    out["local_loaded"] = _worst(pm.full_state_dict(), original)
    bad = dict(original)
    bad.pop("model.norm.weight")
    out["missing"] = _error(lambda: pm.load_state_dict(bad))
    out["not_strict"] = list(pm.load_state_dict(bad | {"extra.weight": torch.zeros(1)}, strict=False))
    wrong = dict(original) | {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
    out["wrong_shape"] = _error(lambda: pm.load_state_dict(wrong))
    out["unchanged_by_refusal"] = _worst(pm.full_state_dict(), original)
    return out


def exported(pm, ref, folder: str) -> dict:
    """``save_pretrained`` against the unsharded model's own: files, modes, config, and ``from_pretrained``."""
    import transformers as T

    out = {}
    pm.save_pretrained(folder)
    out["refused"] = _error(lambda: pm.save_pretrained(folder, push_to_hub=True))
    if dist.get_rank() == 0:
        own = folder + "-hf"
        ref.save_pretrained(own)
        mask = os.umask(0)
        os.umask(mask)
        ours = sorted(p.name for p in Path(folder).iterdir())
        out["files"] = [n for n in sorted(p.name for p in Path(own).iterdir()) if n not in ours]
        out["modes"] = {p.name: oct(p.stat().st_mode & 0o777) for p in Path(folder).iterdir()}
        out["normal_mode"] = oct(0o666 & ~mask)
        out["same_config"] = all(json.loads((Path(folder) / n).read_text()) == json.loads((Path(own) / n).read_text())
                                 for n in ("config.json", "generation_config.json"))
        back = T.AutoModelForCausalLM.from_pretrained(folder)
        out["loaded_exact"] = _worst(back.state_dict(), ref.state_dict())
        out["loaded_type"] = type(back).__name__
    dist.barrier()
    return out


def drop_in_at_two(rank: int, world: int, folder: str) -> dict:
    """The drop-in checks on a Llama captured with labels at tp=2."""
    ref = small_llama()
    pm = autotp.parallelize(ref, tp=2, example_inputs={"input_ids": _ids(1), "labels": _ids(1)})
    # a copy of the model's config (it also carries the layout Trainer reads, which is never written out)
    out = {"config": pm.config.to_dict() == ref.config.to_dict() and pm.config is not ref.config, "device": str(pm.device), "dtype": str(pm.dtype),
           "generation_config": pm.generation_config.to_dict() == ref.generation_config.to_dict()}
    ids, labels = _ids(5, 3, 6), _ids(6, 3, 6)
    pm.eval(), ref.eval()
    without = pm(input_ids=ids)
    out["eval_keys"] = list(without.keys())
    out["eval_logits"] = float((without.logits - ref(input_ids=ids).logits).abs().max())
    out["positional"] = float((pm(ids).logits - ref(ids).logits).abs().max())
    out["eval_loss"] = float((pm(input_ids=ids, labels=labels).loss - ref(input_ids=ids, labels=labels).loss).abs())
    out["step_without_labels"] = _error(lambda: pm.loss(input_ids=ids))
    pm.prepare_generation()  # the steps captured now: the first generate below captures nothing
    out["prepared"] = pm.generation.cached is not None
    greedy = pm.generate(ids, max_new_tokens=4, num_beams=1, use_cache=True)
    out["generate"] = torch.equal(greedy, ref.generate(ids, max_new_tokens=4, do_sample=False))
    from transformers import GenerationConfig

    given = GenerationConfig(max_new_tokens=3, do_sample=False)
    out["given_config"] = torch.equal(pm.generate(ids, generation_config=given),
                                      ref.generate(ids, generation_config=given))
    before = pm.generation_config.max_new_tokens
    pm.generation_config.max_new_tokens = 2  # the config generate reads, as on a transformers model
    out["edited_config"] = pm.generate(ids).shape[1] - ids.shape[1]
    pm.generation_config.max_new_tokens = before  # as the model's again, for the export below
    out["beams"] = _error(lambda: pm.generate(ids, max_new_tokens=4, num_beams=2))
    out["penalty"] = _error(lambda: pm.generate(ids, max_new_tokens=4, repetition_penalty=1.2))
    out["unknown"] = _error(lambda: pm.generate(ids, max_new_tokens=4, foo=1))
    pm.train(), ref.train()
    out |= exported(pm, ref, folder)
    out |= state_dicts(pm, ref)
    return out


def labels_not_captured(rank: int, world: int) -> dict:
    """A module captured without labels, given labels: refused, saying how to capture them."""
    ref = small_llama()
    pm = autotp.parallelize(ref, tp=2, example_inputs={"input_ids": _ids(1)})
    ids = _ids(2)
    return {"refused": _error(lambda: pm(input_ids=ids, labels=ids)),
            "without": float((pm(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())}


def _loads_both_ways(pm, ref) -> tuple[dict, dict, float]:
    """``pm``'s own state dict and ``ref``'s, then ``ref`` moved off them and its full state dict loaded into ``pm``
    (how far ``pm`` then is from it), then ``pm``'s own state dict loaded back; ``ref`` keeps its moved weights."""
    mine = copy.deepcopy(pm.state_dict())  # its values are the live tensors, as nn.Module.state_dict's
    original = copy.deepcopy(ref.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02)
    pm.load_state_dict(ref.state_dict())
    loaded = _worst(pm.full_state_dict(), ref.state_dict())
    pm.load_state_dict(mine)
    return mine, original, loaded


def pipeline_state(rank: int, world: int) -> dict:
    """At pp=2 each rank's ``state_dict`` holds its stage's keys; a full state dict loads into both stages."""
    ref = small_llama()
    pm = autotp.parallelize(ref, tp=1, pp=2, example_inputs={"input_ids": _ids(1), "labels": _ids(1)})
    mine, original, loaded = _loads_both_ways(pm, ref)
    keys = [None] * world
    dist.all_gather_object(keys, sorted(mine))
    ids = _ids(4)
    ref.load_state_dict(original)
    pm.eval(), ref.eval()
    return {"cover": sorted(set(keys[0]) | set(keys[1])) == sorted(original), "split": keys[0] != keys[1],
            "loaded": loaded, "local_loaded": _worst(pm.full_state_dict(), original),
            "eval_without_labels": float((pm(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())}


def fsdp_state(rank: int, world: int) -> dict:
    """Under dp_mode='fsdp' (dp=2): a full state dict loads (each replica keeps its FSDP shard), and the module's
    own state dict (its local shards) loads back."""
    ref = small_llama()
    pm = autotp.parallelize(ref, tp=1, dp=2, dp_mode="fsdp", example_inputs={"input_ids": _ids(1)})
    mine, original, loaded = _loads_both_ways(pm, ref)
    return {"keys": list(mine) == list(original), "loaded": loaded,
            "local_loaded": _worst(pm.full_state_dict(), original)}
