"""Per-rank bodies of the correctness tests (randomness, modes, weights, padding, rank failures) on gloo."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.testing import assert_close

import autotp
from examples.gpt import build_gpt
from tests import models

SEED = 7
STEPS = 3
LR = 0.5


def _gpt2():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=models.VOCAB, n_embd=64, n_layer=2, n_head=4)  # dropouts 0.1
    return transformers.GPT2LMHeadModel(cfg)


DROPOUT_MODELS = {"gpt_dropout0.2": lambda: build_gpt(n_layer=2, dropout=0.2), "hf_gpt2_default": _gpt2}


def _loss(out, target):
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def dropout_training(rank: int, world: int) -> dict:
    """3 SGD steps with dropout on: losses and every parameter equal a single process seeded alike, and
    replicated parameters stay bit-identical across ranks whose global generators differ."""
    out = {}
    for name, build in DROPOUT_MODELS.items():
        torch.manual_seed(0)
        model = build().train()
        ref = copy.deepcopy(model)
        x, y = models.tokens(2, 16, 1), models.tokens(2, 16, 2)
        pm = autotp.parallelize(model, tp=world, vocab="split", example_inputs=(x,))
        torch.manual_seed(100 + rank)  # the ranks' global generators now differ
        pm.manual_seed(SEED)
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
        losses = []
        for _ in range(STEPS):
            losses.append(pm.step(x, target=y, loss_fn=_loss).item())
            opt.step(), opt.zero_grad()
        torch.manual_seed(SEED)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        ref_losses = []
        for _ in range(STEPS):
            loss = _loss(ref(x), y)
            loss.backward()
            ref_opt.step(), ref_opt.zero_grad()
            ref_losses.append(loss.item())
        assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        full = pm.full_state_dict()
        worst = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items() if v.is_floating_point())
        assert worst < 1e-5, f"{name}: parameters after {STEPS} steps differ by {worst}"
        mine = {k: v for k, v in pm.local_state_dict().items() if not pm.plan.placements.get(k, None) or
                not pm.plan.placements[k].is_split}
        drift = _cross_rank_drift(mine)
        assert drift == 0.0, f"{name}: replicated parameters differ across ranks by {drift}"
        out[name] = {"losses": losses, "worst": worst}
    return out


def _cross_rank_drift(tensors: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for value in tensors.values():
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, value.contiguous())
        worst = max(worst, max((p - parts[0]).abs().max().item() for p in parts))
    return worst


def modes_and_weights(rank: int, world: int) -> dict:
    """train()/eval() switch dropout as on the original, whichever mode it was captured in; ranks built
    with different seeds all hold rank 0's model; padded batches through padding rows train exactly."""
    x = models.tokens(2, 16, 1)
    torch.manual_seed(rank)  # each rank builds different weights: rank 0's must win
    model = build_gpt(n_layer=2, dropout=0.2)
    for start_in_train in (True, False):
        model.train(start_in_train)
        pm = autotp.parallelize(model, tp=world, vocab="split", example_inputs=(x,))
        assert pm.training == start_in_train
        pm.eval()
        first, second = pm(x), pm(x)
        assert torch.equal(first, second), "eval mode must not apply dropout"
        if rank == 0:
            assert_close(first, model.eval()(x), rtol=1e-5, atol=1e-6)
        gathered = [torch.empty_like(first) for _ in range(world)]
        dist.all_gather(gathered, first)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks disagree: weights not from one source"
        pm.train()
        pm.manual_seed(SEED)
        trained = pm(x)
        torch.manual_seed(SEED)
        expected = copy.deepcopy(model).train()(x)
        dist.broadcast(expected, src=0)  # rank 0's model is the one every rank holds
        assert_close(trained, expected, rtol=1e-5, atol=1e-6)
        assert not torch.equal(trained, first), "train mode must apply dropout"
    padded = {}
    # 81: a vocabulary tp=2 does not divide, split 41 + 40 (gathers padded to the longer chunk), trained on the
    # default loss, which runs the vocab-parallel cross-entropy on the logits' shards outside the graph
    for case, tied, vocab, pad, loss_fn in (("True", True, 64, 3, _loss), ("False", False, 64, 3, _loss),
                                            ("81", False, 81, 80, None)):
        torch.manual_seed(0)
        # float64: the loss_fn is captured with the model, its cross-entropy vocabulary-parallel, and a tied head's
        # two gradients sum in another order; AdamW turns that rounding at near-zero gradients into 3.5e-4 in
        # float32 after these steps, 4e-10 in float64 (untied: 2e-16). A wrong rule would not shrink so.
        lm = models.PaddedLM(tied, vocab=vocab, pad=pad).double()
        ref = copy.deepcopy(lm)
        ids = models.padded_ids(pad, vocab)
        pm = autotp.parallelize(lm, tp=world, vocab="split", example_inputs=(ids,))
        assert pm.plan.placements["embed.weight"].is_split
        opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for _ in range(STEPS):
            pm.step(ids, target=ids, loss_fn=loss_fn), opt.step(), opt.zero_grad()
            _loss(ref(ids), ids).backward(), ref_opt.step(), ref_opt.zero_grad()
        full = pm.full_state_dict()
        for key, want in ref.state_dict().items():
            assert_close(full[key], want, rtol=1e-8, atol=1e-8, msg=lambda m: f"{case} {key}: {m}")
        assert_close(pm(ids), ref(ids), rtol=1e-8, atol=1e-8)  # the logits gathered whole, at full width
        padded[case] = True
    return {"padded": padded, "default_group_held": pm.comm.group is not None}


def peer_failure(rank: int, world: int) -> str:
    """Rank 1 stops before a collective; rank 0's forward fails with a RankFailure naming itself."""
    x = models.tokens(2, 8, 0)
    pm = autotp.parallelize(models.build("gpt"), tp=world, vocab="split", example_inputs=(x,))
    dist.barrier()
    if rank == 1:
        dist.destroy_process_group()
        return "stopped"
    try:
        pm(x)
    except autotp.RankFailure as e:
        return str(e)
    return "no error"
