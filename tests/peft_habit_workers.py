"""Rank workers for peft's habits on a LoRA parallel module (``test_peft_habits``): ``disable_adapter`` against peft's
on the unsharded model, peft's trainable count, the refusals, and TRL's DPOTrainer, on one rank group."""

from __future__ import annotations

import torch

import autotp
from autotp.errors import InputError
from tests import dpo_workers, lora_workers, models


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _refused(call) -> str:
    """The message of the ``InputError`` that ``call()`` raises ('' when it raises none)."""
    try:
        call()
    except InputError as e:
        return str(e)
    return ""


def adapters_off(pm, model, batch: dict) -> dict:
    """``disable_adapter`` on ``pm`` against peft's on ``model`` (the same peft model, unsharded): the reference pass
    of a DPO step (the policy's forward first, the reference's with the adapters off, then the backward), its
    outputs, the base model's outputs, and the gradients."""
    out = {}
    policy, theirs = pm(**batch), model(**batch)
    with torch.no_grad(), pm.disable_adapter(), model.disable_adapter():
        off, off_theirs = _logits(pm(**batch)), _logits(model(**batch))
        out["refused_inside"] = _refused(pm.state_dict)
    with torch.no_grad():
        base = _logits(lora_workers.llama()(**batch))
    out["off"] = (off - off_theirs).abs().max().item()
    out["off_is_base"] = (off - base).abs().max().item()
    out["on_moved"] = (_logits(policy) - off).abs().max().item()  # the adapters do change the output
    policy.loss.backward()  # after the block: the adapters' values were never written
    theirs.loss.backward()
    mine = pm.state_dict(keep_vars=True)
    graded = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    out["grads"] = max((_full(pm, k) - g).abs().max().item() for k, g in graded.items())
    out["graded"] = sorted(k for k, t in mine.items() if t.grad is not None) == sorted(graded)
    out["counts"] = list(pm.get_nb_trainable_parameters()) == list(model.get_nb_trainable_parameters())
    pm.zero_grad(set_to_none=True)
    return out


def _full(pm, key: str) -> torch.Tensor:
    """The full gradient of parameter ``key`` (gathered over the tp ranks when split)."""
    from autotp.runtime.state import gather_tp
    from autotp.runtime.tp_params import plain

    grad = plain(pm.state_dict(keep_vars=True)[key].grad)
    return gather_tp(pm.plan, key, grad, pm.comm, pm._names.shapes.get(key))


def habits(rank: int, world: int, folder: str) -> dict:
    """On ``world`` ranks: ``adapters_off`` and generation with the adapters off, the refusals, then DPOTrainer
    (``dpo_workers``): refused without a reference, exact with a frozen parallel module as its reference."""
    from tests.trainer_workers import reset_accelerate

    model = lora_workers.adapted()
    batch = dpo_workers.example()
    pm = autotp.parallelize(model, tp=world, example_inputs=batch, quiet=True)
    out = adapters_off(pm, model, batch)
    out["set_other"] = _refused(lambda: pm.set_adapter("other"))
    out["merge_and_unload"] = _refused(pm.merge_and_unload)
    reset_accelerate()
    pm.config._name_or_path = f"{folder}/base"  # as from_pretrained sets it: TRL loads the reference from there
    out["no_reference"] = _refused(lambda: dpo_workers.trained(pm, autotp.parallelism_config(pm)))
    out["precompute"] = _refused(lambda: dpo_workers.trained(pm, autotp.parallelism_config(pm), precompute=True))
    out["dpo"] = dpo_workers.sharded(rank, world, folder)
    out.update(generation_off(world))
    out["pipeline_off"] = pipeline_off(world)
    return out


def pipeline_off(world: int) -> float:
    """The largest difference from peft's outputs with the adapters off, on a pipeline of ``world`` stages (the
    stand-ins reach every stage's graph)."""
    model = lora_workers.adapted().eval()
    x = models.tokens(2, 8, 1)
    pm = autotp.parallelize(model, tp=1, pp=world, example_inputs=(x,), quiet=True).eval()
    with torch.no_grad(), pm.disable_adapter(), model.disable_adapter():
        return (_logits(pm(x)) - _logits(model(x))).abs().max().item()


def generation_off(world: int) -> dict:
    """Greedy generation with the adapters off equals peft's with them off (a module captured on ids alone, as
    ``generate`` needs); ``print_trainable_parameters`` prints peft's line."""
    import contextlib
    import io

    model = lora_workers.adapted().eval()
    pm = autotp.parallelize(model, tp=world, example_inputs=(models.tokens(2, 8, 1),), quiet=True).eval()
    ids = models.tokens(1, 5, 3)
    with pm.disable_adapter(), model.disable_adapter():
        same = torch.equal(pm.generate(ids, max_new_tokens=5, do_sample=False),
                           model.generate(input_ids=ids, max_new_tokens=5, do_sample=False))
    printed = []
    for who in (pm, model):
        with contextlib.redirect_stdout(io.StringIO()) as text:
            who.print_trainable_parameters()
        printed.append(text.getvalue())
    return {"generate": same, "printed": printed[0] == printed[1] and "trainable params" in printed[0]}
