"""Per-rank bodies of the checkpoint and generation tests of expert parallelism on gloo: a Mixtral (4 experts,
top-2, its auxiliary router loss) trained at tp=ep=world, saved as DCP (AdamW's state too) and exported to
Hugging Face's format, then loaded at another layout and compared with the unsharded model trained alike; and
``pm.generate`` at ep against ``model.generate``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autotp
from tests.ep_workers import BUILDERS, _batch, _global_batch, _reference_loss, _sliced
from tests.moe_workers import mixtral
from tests.structures_workers import ADAM, _error


def _errors(full: dict, want: dict) -> float:
    """The largest difference over ``want``'s floating tensors (inf where ``full`` lacks one)."""
    return max((_error(full[k], v) if k in full else float("inf")) for k, v in want.items() if v.is_floating_point())


def _step(pm, opt, batch) -> torch.Tensor:
    loss = pm.step(**batch)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _ref_step(ref, opt, batch) -> torch.Tensor:
    loss = ref(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _resumed(pm, folder, ref_loss: torch.Tensor, after: dict, last: dict) -> dict:
    """``pm`` loaded from the DCP checkpoint (AdamW's state too), then one more step: its loss and parameters
    against the unsharded model's same step."""
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    pm.load(folder / "dcp", optimizer=opt, quiet=True)
    loaded = pm.full_state_dict()
    loss = _step(pm, opt, last)
    return {"loaded": _errors(loaded, after["saved"]), "loss": _error(loss, ref_loss),
            "params": _errors(pm.full_state_dict(), after["trained"])}


def generates_alike(world: int) -> bool:
    """Whether greedy ``pm.generate`` at tp=ep=world (captured on token ids alone, as one serves a model) gives
    ``model.generate``'s tokens."""
    torch.manual_seed(0)
    ref = mixtral().eval()
    ids = _batch(5)["input_ids"][:1, :6]
    pm = autotp.parallelize(ref, tp=world, ep=world, example_inputs=(ids,), quiet=True)
    return torch.equal(pm.generate(ids, max_new_tokens=4, do_sample=False),
                       ref.generate(ids, max_new_tokens=4, do_sample=False))


def across_layouts(rank: int, world: int, folder) -> dict:
    """Saved at tp=ep=world after one AdamW step; loaded at tp=world with the experts tensor-split (ep=1),
    resuming with one more step; the export read by ``from_pretrained``; and greedy generation at ep."""
    import transformers

    torch.manual_seed(0)
    ref = BUILDERS["mixtral"]()
    pm = autotp.parallelize(ref, tp=world, ep=world, example_inputs=_batch(1), quiet=True)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    first, last = _batch(3), _batch(4)
    out = {"step": _error(_step(pm, opt, first), _ref_step(ref, ref_opt, first))}
    saved = pm.full_state_dict()  # what the checkpoint holds: the loads below must give it back bit for bit
    out["saved"] = _errors(saved, ref.state_dict())
    pm.save(folder / "dcp", optimizer=opt)
    pm.save(folder / "hf", format="safetensors")
    ref_loss = _ref_step(ref, ref_opt, last)
    after = {"saved": {k: v for k, v in saved.items() if k in ref.state_dict()}, "trained": ref.state_dict()}

    torch.manual_seed(1)  # other initial weights: every value must come from the checkpoint
    split = autotp.parallelize(BUILDERS["mixtral"](), tp=world, example_inputs=_batch(1), quiet=True)
    out["tp, ep=1"] = _resumed(split, folder, ref_loss, after, last)
    out["tp, ep=1 expert split"] = sorted(n for n, p in split.plan.placements.items() if p.kind.value == "expert")

    dist.barrier()  # the first rank wrote the export; every rank reads it
    exported = transformers.MixtralForCausalLM.from_pretrained(str(folder / "hf"))
    out["from_pretrained"] = _errors(exported.state_dict(), after["saved"])
    out["generate"] = generates_alike(world)
    return out


def _layout(tp: int, dp: int, ep: int, mode: str = "replicate") -> dict:
    """``parallelize``'s keywords for (tp, dp, ep) with replicas under ``mode``."""
    return {"tp": tp, "dp": dp, "ep": ep} | ({"dp_mode": mode} if dp > 1 else {})


def _replica_step(pm, opt, ref, ref_opt, batch: dict, dp: int) -> float:
    """One AdamW step of ``pm`` on its replica's rows of ``batch`` and of ``ref`` on the replicas' mean loss (what
    data parallelism trains); the error of this replica's loss."""
    mine = _sliced(batch, pm.dp_rank if dp > 1 else 0, dp)
    loss = _step(pm, opt, mine)
    want = ref(**mine).loss.detach()
    _reference_loss(ref, batch, dp).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return _error(loss, want)


def through_layouts(rank: int, world: int, folder, layouts: list) -> list:
    """Mixtral trained one AdamW step at each (tp, dp, ep[, dp_mode]) of ``layouts`` in turn, each module made with
    other initial weights and loaded (AdamW's state too) from the DCP checkpoint the one before saved; per layout the
    error of the loaded values against those saved (bit for bit: 0), of the step's loss and of every parameter
    after it against the unsharded model trained alike, and the experts a rank's banks hold."""
    torch.manual_seed(0)
    ref = BUILDERS["mixtral"]()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    out, saved = [], None
    for at, layout in enumerate(layouts):
        tp, dp, ep = layout[:3]
        torch.manual_seed(at)  # other initial weights after the first: every value must come from the checkpoint
        pm = autotp.parallelize(BUILDERS["mixtral"](), example_inputs=_batch(1), quiet=True, **_layout(*layout))
        opt = torch.optim.AdamW(pm.parameters(), **ADAM)
        row = {"layout": tuple(layout)}
        if saved is not None:
            pm.load(folder / f"dcp{at - 1}", optimizer=opt, quiet=True)
            row["loaded"] = _errors(pm.full_state_dict(), saved)
        row["loss"] = _replica_step(pm, opt, ref, ref_opt, _global_batch(3 + at), dp)
        full = pm.full_state_dict()
        row["params"] = _errors(full, ref.state_dict())
        saved = {k: v.clone() for k, v in full.items() if k in ref.state_dict()}
        pm.save(folder / f"dcp{at}", optimizer=opt)
        local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in pm.named_parameters()}
        row["local_experts"] = sorted({p.shape[0] for n, p in local.items() if "experts" in n and p.dim() == 3})
        out.append(row)
    return out
