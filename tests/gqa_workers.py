"""Per-rank bodies of the tests of grouped-query attention above its KV heads (tp=4, 2 KV heads) on gloo: each
rank keeps the KV head its query heads use, trains exactly, clips as one process does, and its checkpoints and
exports hold every chunk once."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import autotp
from autotp.runtime.data_parallel import local as local_piece
from tests import models
from tests.checkpoint_workers import ADAM, _same_state, llama

CLIP = 0.05
"""Small enough that clipping scales every step: a norm counting a shared chunk twice would show."""


def _step(pm, opt, x, y) -> None:
    pm.step(x, target=y, loss_fn=models.loss_fn)
    pm.clip_grad_norm_(CLIP)
    opt.step()
    opt.zero_grad()


def _ref_step(ref, opt, x, y) -> None:
    models.loss_fn(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    opt.step()
    opt.zero_grad()


def shared_kv_heads(rank: int, world: int, folder: str) -> dict:
    """tp=4 from a .safetensors file with the model on meta; AdamW steps with clipping against one process; DCP
    and safetensors out; the DCP back at tp=2 (two groups of two) and tp=4, each trained one more step."""
    folder = Path(folder)
    ref, example = llama(layers=1), (models.tokens(2, 8, seed=1),)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"},
                  str(folder / "tiny.safetensors"))
    dist.barrier()
    pm = autotp.parallelize(llama(meta=True, layers=1), tp=world, example_inputs=example,
                            checkpoint=folder / "tiny.safetensors", quiet=True)
    local = dict(pm.local_state_dict())
    result = {"k_proj": list(local["model.layers.0.self_attn.k_proj.weight"].shape),
              "local_params": sum(local_piece(p).numel() for p in pm.parameters()),
              "planned_params": sum(p.numel() // (pm.plan.placements[n].chunks(world) if pm.plan.placements[n].is_split
                                                  else 1) for n, p in ref.named_parameters()),
              "whole_kv_params": sum(p.numel() * (world - 2) // world for n, p in ref.named_parameters()
                                     if pm.plan.placements[n].replicas != 1)}
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    batches = [(models.tokens(4, 8, seed=10 + i), models.tokens(4, 8, seed=20 + i)) for i in range(3)]
    for x, y in batches[:2]:
        _step(pm, opt, x, y)
        _ref_step(ref, ref_opt, x, y)
    saved = pm.full_state_dict()
    _same_state(saved, ref.state_dict(), "tp=4 after clipped AdamW steps")
    pm.save(folder / "dcp", optimizer=opt)
    pm.save(folder / "export", format="safetensors")
    _ref_step(ref, ref_opt, *batches[2])
    after = ref.state_dict()

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for tp, group in ((2, pairs[rank // 2]), (world, None)):
        again = autotp.parallelize(llama(meta=True, layers=1), tp=tp, example_inputs=example, checkpoint=folder / "dcp",
                                   group=group, quiet=True)
        _same_state(again.full_state_dict(), saved, f"DCP at tp=4 -> tp={tp}", exact=True)
        again_opt = torch.optim.AdamW(again.parameters(), **ADAM)
        again.load(folder / "dcp", optimizer=again_opt, quiet=True)
        _step(again, again_opt, *batches[2])
        _same_state(again.full_state_dict(), after, f"resumed at tp={tp}")

    import transformers

    exported = transformers.LlamaForCausalLM.from_pretrained(str(folder / "export"))
    _same_state(exported.state_dict(), saved, "export -> from_pretrained", exact=True)
    return result
