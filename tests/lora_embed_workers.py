"""Per-rank bodies of the embedding-adapter and ``modules_to_save`` tests on gloo: AdamW steps exactly as one
process takes them, and the peft files round trip both ways."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autotp
from tests import lora_workers, models
from tests.checkpoint_workers import ADAM


def adapted(seed: int = 1):
    """The one-layer tiny Llama with LoRA on every projection and the token embedding, and a trainable copy of the
    LM head (``modules_to_save``): every trainable tensor drawn at random (peft starts B, and an embedding's A, at
    zero)."""
    import peft

    config = peft.LoraConfig(r=lora_workers.RANK, lora_alpha=8, modules_to_save=["lm_head"],
                             target_modules=[*lora_workers.TARGETS, "embed_tokens"])
    model = peft.get_peft_model(lora_workers.llama(1), config)
    torch.manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    return model


def _loss(out, target):
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _logits(out):
    return getattr(out, "logits", out)


def _worst(got: dict, want: dict) -> float:
    return max((got[k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point())


def dora(rank: int, world: int) -> dict:
    """AdamW steps of a DoRA-adapted Llama (every projection) at tp=world against one process: the worst
    difference of any parameter after the steps, and how far the adapters moved."""
    import peft

    model = peft.get_peft_model(lora_workers.llama(1), peft.LoraConfig(r=lora_workers.RANK, use_dora=True,
                                                                       target_modules=lora_workers.TARGETS))
    torch.manual_seed(1)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.05)
    start, ref = copy.deepcopy(model.state_dict()), copy.deepcopy(model)
    x, y = models.tokens(2, 8, 1), models.tokens(2, 8, 2)
    pm = autotp.parallelize(model, tp=world, example_inputs=(x,), quiet=True)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], **ADAM)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAM)
    for _ in range(lora_workers.STEPS):
        pm.step(x, target=y, loss_fn=_loss)
        opt.step(), opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step(), ref_opt.zero_grad()
    return {"worst": _worst(pm.full_state_dict(), ref.state_dict()), "moved": _worst(ref.state_dict(), start)}


def trained_and_saved(rank: int, world: int, folder: str) -> dict:
    """AdamW steps of the adapted model at tp=world against one process; the frozen base without gradients; then
    ``save_pretrained`` writes the tensors peft's ``get_peft_model_state_dict`` picks, which
    ``PeftModel.from_pretrained`` loads with the trained model's outputs; a peft-saved adapter (embedding adapter and
    ``modules_to_save`` copy included) loads into the parallel module with peft's outputs and generation, and
    merged there (the embedding's adapter too) computes what peft's ``merge_and_unload`` does."""
    import peft

    model = adapted().train()
    ref = copy.deepcopy(model)
    x, y = models.tokens(2, 8, 1), models.tokens(2, 8, 2)
    pm = autotp.parallelize(model, tp=world, example_inputs=(x,), vocab="split", quiet=True)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], **ADAM)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAM)
    for _ in range(lora_workers.STEPS):
        pm.step(x, target=y, loss_fn=_loss)
        frozen_grads = [n for n, p in pm.named_parameters() if not p.requires_grad and p.grad is not None]
        opt.step(), opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step(), ref_opt.zero_grad()
    out = {"worst": _worst(pm.full_state_dict(), ref.state_dict()), "frozen_grads": frozen_grads,
           "moved": _worst(ref.state_dict(), adapted().state_dict())}
    ours, theirs = f"{folder}/ours", f"{folder}/theirs"
    pm.eval(), ref.eval()
    pm.save_pretrained(ours)
    from safetensors.torch import load_file

    saved = load_file(f"{ours}/adapter_model.safetensors")
    want = peft.get_peft_model_state_dict(ref)
    out["keys"] = sorted(saved) == sorted(want)
    out["saved_values"] = _worst(saved, want)
    loaded = peft.PeftModel.from_pretrained(lora_workers.llama(1), ours).eval()
    out["saved"] = (_logits(loaded(x)) - _logits(ref(x))).abs().max().item()
    other = adapted(seed=7).eval()
    if rank == 0:
        other.save_pretrained(theirs)
    dist.barrier()
    pm.load_adapter(theirs)
    out["loaded"] = (_logits(pm(x)) - _logits(other(x))).abs().max().item()
    ids = models.tokens(1, 5, 3)
    out["generate"] = bool(torch.equal(pm.generate(ids, max_new_tokens=4, do_sample=False),
                                       other.generate(input_ids=ids, max_new_tokens=4, do_sample=False)))
    pm.merge_adapters()
    merged = other.merge_and_unload().eval()
    out["merged"] = (_logits(pm(x)) - _logits(merged(x))).abs().max().item()
    table = pm.full_state_dict()["base_model.model.model.embed_tokens.base_layer.weight"]
    out["merged_table"] = (table - merged.state_dict()["model.embed_tokens.weight"]).abs().max().item()
    out["dora"] = dora(rank, world)  # on the same ranks: a spawned group is the costly part
    return out
