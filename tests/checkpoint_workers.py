"""Per-rank bodies of the checkpoint tests (importable, so spawned ranks can run them).

One spawn of 2 gloo ranks walks the whole workflow on a tiny Hugging Face Llama with tied embeddings: a model
that never exists whole (parameters on the meta device) loaded from a .safetensors file and from a sharded
Hugging Face directory, trained, saved as DCP with its optimizer, resumed at the same layout and at others,
and exported for ``from_pretrained``. Every comparison is against the unsharded model in this process.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

import autotp
from autotp.runtime.data_parallel import local
from tests import models

ADAM = dict(lr=1e-3, eps=1e-6)


def llama(meta: bool = False, layers: int = 2) -> nn.Module:
    """The tiny tied-embedding Llama (seeded); ``meta``: parameters on the meta device, buffers real. One layer
    where a test checks what a layer holds, not what passes between layers (each layer is captured: time)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with autotp.empty_weights() if meta else contextlib.nullcontext():
        return transformers.LlamaForCausalLM(config)


def _same_state(full: dict, want: dict, label: str, exact: bool = False) -> None:
    assert set(full) == set(want), f"{label}: keys differ: {sorted(set(full) ^ set(want))[:4]}"
    for key, value in want.items():
        if exact:
            assert torch.equal(full[key], value), f"{label}: {key} differs"
        else:
            assert_close(full[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label}: {key}: {m}")


def _train(pm, opt, batches) -> None:
    for x, y in batches:
        pm.step(x, target=y, loss_fn=models.loss_fn)
        opt.step()
        opt.zero_grad()


def _write_sources(ref: nn.Module, folder: Path) -> None:
    """A single .safetensors file (tied head left out, as Hugging Face writes it) and a sharded HF directory."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "tiny.safetensors"))
    ref.save_pretrained(str(folder / "hf"), max_shard_size="100KB")


def workflow(rank: int, world: int, folder: str) -> dict:
    """The checkpoint workflow at tp=2 and its resumptions; returns what the test asserts beyond the checks."""
    folder = Path(folder)
    ref, example = llama(), (models.tokens(2, 8, seed=1),)
    if rank == 0:
        _write_sources(ref, folder)
    dist.barrier()
    results = {"hf_files": sorted(p.name for p in (folder / "hf").iterdir())}

    # 1. Parameters on meta, buffers missing: refused before anything is captured, naming them.
    with torch.device("meta"):
        bare = llama()
    try:
        autotp.parallelize(bare, tp=2, example_inputs=example, checkpoint=folder / "tiny.safetensors")
        results["meta_buffer_error"] = "no error"
    except autotp.InputError as e:
        results["meta_buffer_error"] = str(e)

    # 2. A model that never exists whole, from one .safetensors file at tp=2: outputs and every tensor exact.
    pm = autotp.parallelize(llama(meta=True), tp=2, example_inputs=example, checkpoint=folder / "tiny.safetensors",
                            quiet=rank != 0)
    x = models.tokens(3, 12, seed=2)
    assert_close(pm(x).logits, ref(x).logits, rtol=1e-5, atol=1e-6)
    _same_state(pm.full_state_dict(), ref.state_dict(), "meta + safetensors", exact=True)

    # 3. Train alongside the original, save (DCP, with the optimizer), train on: the uninterrupted run.
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    batches = [(models.tokens(4, 8, seed=10 + i), models.tokens(4, 8, seed=20 + i)) for i in range(4)]
    _train(pm, opt, batches[:2])
    for bx, by in batches[:2]:
        models.loss_fn(ref(bx), by).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    saved = pm.full_state_dict()
    _same_state(saved, ref.state_dict(), "trained at tp=2")
    pm.save(folder / "dcp", optimizer=opt)
    pm.save(folder / "export", format="safetensors", max_shard_bytes=100_000)
    _train(pm, opt, batches[2:])
    uninterrupted = pm.full_state_dict()

    # 4. Resume at the same layout: the model and AdamW's state come back, two more steps equal the run above.
    again = autotp.parallelize(llama(meta=True), tp=2, example_inputs=example, checkpoint=folder / "dcp", quiet=True)
    _same_state(again.full_state_dict(), saved, "DCP at tp=2 -> tp=2", exact=True)
    again_opt = torch.optim.AdamW(again.parameters(), **ADAM)
    again.load(folder / "dcp", optimizer=again_opt, quiet=True)
    _train(again, again_opt, batches[2:])
    _same_state(again.full_state_dict(), uninterrupted, "resumed at tp=2", exact=True)

    # 5. Resharded: the tp=2 checkpoint at (tp=1, pp=2), optimizer included, trained on through the pipeline.
    piped = autotp.parallelize(llama(meta=True), tp=1, pp=2, example_inputs=example, checkpoint=folder / "dcp",
                               microbatches=2, quiet=True)
    _same_state(piped.full_state_dict(), saved, "DCP at tp=2 -> (tp=1, pp=2)", exact=True)
    piped_opt = torch.optim.AdamW(piped.parameters(), **ADAM)
    piped.load(folder / "dcp", optimizer=piped_opt, quiet=True)
    _train(piped, piped_opt, batches[2:])
    _same_state(piped.full_state_dict(), uninterrupted, "resumed at (tp=1, pp=2)")
    results["pipeline_local_params"] = sum(local(p).numel() for p in piped.parameters())

    # 6. One rank alone (tp=1): the sharded Hugging Face directory, then the tp=2 DCP checkpoint.
    solo = [dist.new_group([r]) for r in range(world)][rank]
    alone = autotp.parallelize(llama(meta=True), tp=1, example_inputs=example, checkpoint=folder / "hf", group=solo,
                               quiet=True)
    _same_state(alone.full_state_dict(), llama().state_dict(), "HF sharded directory at tp=1", exact=True)
    alone.load(folder / "dcp", quiet=True)
    _same_state(alone.full_state_dict(), saved, "DCP at tp=2 -> tp=1", exact=True)

    # 7. The safetensors export loads with transformers' from_pretrained and equals full_state_dict().
    import transformers

    exported = transformers.LlamaForCausalLM.from_pretrained(str(folder / "export"))
    _same_state(exported.state_dict(), saved, "export -> from_pretrained", exact=True)
    results["export_files"] = sorted(p.name for p in (folder / "export").iterdir())
    results["dcp_keys"] = sorted(_dcp_keys(folder / "dcp"))
    results["odd_vocabulary"] = _odd_vocabulary(folder, rank)
    return results


def _odd_vocabulary(folder: Path, rank: int) -> dict[str, list[int]]:
    """A vocabulary of 81 split 41 + 40 at tp=2: saved as DCP and as safetensors with the full 81 rows, loaded back
    at tp=2 and at tp=1 (whole); the shapes the safetensors file holds."""
    from safetensors import safe_open

    torch.manual_seed(0)
    ref, ids = models.PaddedLM(tied=False, vocab=81, pad=80), models.padded_ids(80, 81)
    pm = autotp.parallelize(ref, tp=2, example_inputs=(ids,), vocab="split", quiet=True)
    assert pm.plan.placements["head.weight"].is_split
    pm.save(folder / "odd_dcp")
    pm.save(folder / "odd_st", format="safetensors")
    for tp in (2, 1):
        group = dist.new_group([rank]) if tp == 1 else None  # every rank makes each group, in the same order
        with autotp.empty_weights():
            bare = models.PaddedLM(tied=False, vocab=81, pad=80)
        back = autotp.parallelize(bare, tp=tp, example_inputs=(ids,), vocab="split", checkpoint=folder / "odd_dcp",
                                  quiet=True, **({"group": group} if tp == 1 else {}))
        _same_state(back.full_state_dict(), ref.state_dict(), f"81 rows: DCP at tp=2 -> tp={tp}", exact=True)
        assert_close(back(ids), ref(ids), rtol=1e-6, atol=1e-6)
    with safe_open(str(folder / "odd_st" / "model.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def _dcp_keys(path: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)



def state_error(full: dict, want: dict) -> float:
    """The largest difference between two state dicts beyond a 1e-5 relative tolerance (inf if their keys differ)."""
    if set(full) != set(want):
        return float("inf")
    excess = [((full[k].double() - v.double()).abs() - 1e-5 * v.double().abs()).max() for k, v in want.items()
              if isinstance(v, torch.Tensor) and v.numel()]
    return float(max(excess).clamp(min=0)) if excess else 0.0


def dp_checkpoints(rank: int, world: int, path: str) -> dict[str, float]:
    """On 4 ranks: dp=2 x tp=2 fsdp replicas train 2 AdamW steps on their halves of the batch and save (DCP with
    the optimizer, and a safetensors export); replicate replicas, fsdp replicas and a tp=4 module each load it,
    and go on one more step. Returns each state's error against one process after the same steps."""
    folder = Path(path)
    x, y = models.tokens(8, 12, 5), models.tokens(8, 12, 6)
    ref = llama(layers=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)

    def ref_step():
        nn.functional.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).backward()
        ref_opt.step(), ref_opt.zero_grad()

    def step(pm, opt):
        rows = slice(pm.dp_rank * len(x) // pm.dp_size, (pm.dp_rank + 1) * len(x) // pm.dp_size)
        pm.step(x[rows], target=y[rows])
        opt.step(), opt.zero_grad()

    saver = autotp.parallelize(llama(layers=1), tp=2, dp=2, example_inputs=x[:2], vocab="split", quiet=True)
    opt = torch.optim.AdamW(saver.parameters(), **ADAM)
    for _ in range(2):
        step(saver, opt), ref_step()
    saver.save(folder / "dcp", optimizer=opt)
    saver.save(folder / "hf", format="safetensors")
    after_two = {k: v.clone() for k, v in ref.state_dict().items()}
    errors = {"fsdp dp=2 trained": state_error(saver.full_state_dict(), after_two)}
    ref_step()
    for label, layout in [("replicate", dict(tp=2, dp=2, dp_mode="replicate")), ("fsdp", dict(tp=2, dp=2)),
                          ("tp=4", dict(tp=4))]:
        pm = autotp.parallelize(llama(layers=1), example_inputs=x[:2], vocab="split", quiet=True, **layout)
        pm_opt = torch.optim.AdamW(pm.parameters(), **ADAM)
        pm.load(folder / "dcp", optimizer=pm_opt, quiet=True)
        errors[f"{label} loaded"] = state_error(pm.full_state_dict(), after_two)
        step(pm, pm_opt)
        errors[f"{label} after a resumed step"] = state_error(pm.full_state_dict(), ref.state_dict())
    import transformers

    exported = transformers.LlamaForCausalLM.from_pretrained(folder / "hf").state_dict()
    errors["exported at dp=2, loaded by from_pretrained"] = state_error(exported, after_two)
    return errors
