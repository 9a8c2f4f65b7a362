"""Per-rank bodies of the recompute tests: blocks recomputed in backward train exactly as kept activations do,
dropout on (the recomputed masks are the first forward's)."""

from __future__ import annotations

import copy

import torch
from torch.testing import assert_close

import autotp
from autotp.rewrite.recompute import Recomputed
from tests import dp_workers, models, schedule_workers
from tests.correctness_workers import DROPOUT_MODELS, SEED
from tests.workers import ADAM, STEPS, _check_grads

LM_LOSS = models.loss_fn


def recomputed_blocks(pm) -> int:
    """How many recomputed blocks the rank's modules hold."""
    return sum(isinstance(m, Recomputed) for root in pm.rank_modules() for m in root.modules())


def tensor_parallel_dropout(rank: int, world: int) -> dict:
    """tp=world, recompute="blocks", dropout on: loss, every gradient and every parameter after AdamW steps equal
    one process seeded alike."""
    out = {}
    for name, build in DROPOUT_MODELS.items():
        torch.manual_seed(0)
        model = build().train()
        ref = copy.deepcopy(model)
        x, y = models.tokens(2, 16, 1), models.tokens(2, 16, 2)
        pm = autotp.parallelize(model, tp=world, example_inputs=(x,), recompute="blocks")
        torch.manual_seed(100 + rank)  # the ranks' global generators differ: only the stream may matter
        pm.manual_seed(SEED)
        opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
        ref_losses, losses = [], []
        with torch.random.fork_rng(devices=[]):  # the reference's stream: SEED's, continued step after step
            torch.manual_seed(SEED)
            ref_state = torch.get_rng_state()
        for step in range(STEPS):
            losses.append(pm.step(x, target=y, loss_fn=LM_LOSS))
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(ref_state)
                ref_loss = LM_LOSS(ref(x), y)
                ref_state = torch.get_rng_state()
            ref_loss.backward()
            ref_losses.append(ref_loss.detach())
            assert_close(losses[-1], ref_losses[-1], rtol=1e-5, atol=0, msg=lambda m: f"{name} step {step} loss: {m}")
            _check_grads(pm, ref, f"{name} recompute step {step}")
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        full = pm.full_state_dict()
        for key, want in ref.state_dict().items():
            assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {key} after AdamW: {m}")
        out[name] = {"blocks": recomputed_blocks(pm), "losses": [float(v) for v in losses]}
    return out


def _pipeline_run(schedule: str, recompute: str) -> tuple[list[float], dict, int]:
    torch.manual_seed(0)
    model = DROPOUT_MODELS["gpt_dropout0.2"]().train()
    x, y = models.tokens(8, 12, 1), models.tokens(8, 12, 2)
    pm = autotp.parallelize(model, tp=1, pp=2, example_inputs=(models.tokens(2, 16, 1),), microbatches=4,
                            schedule=schedule, recompute=recompute)
    pm.manual_seed(SEED)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    losses = []
    for _ in range(STEPS):
        losses.append(float(pm.step(x, target=y, loss_fn=LM_LOSS)))
        opt.step(), opt.zero_grad()
    return losses, pm.full_state_dict(), recomputed_blocks(pm)


def pipeline_dropout(rank: int, world: int, schedules: list[str]) -> dict:
    """pp=world: with dropout on, recompute="blocks" trains bit for bit as kept activations do (pipeline masks
    are per rank, not a single process's, so the reference is the same pipeline without recompute); without
    dropout, recompute matches the unsharded model (``schedule_workers.check_schedule``)."""
    out = {}
    for schedule in schedules:
        kept_losses, kept, _ = _pipeline_run(schedule, "none")
        losses, state, blocks = _pipeline_run(schedule, "blocks")
        assert losses == kept_losses, f"{schedule}: losses {losses} with recompute, {kept_losses} without"
        for key, want in kept.items():
            assert torch.equal(state[key], want), f"{schedule}: {key} differs with recompute"
        exact = schedule_workers.check_schedule("gpt", 1, world, schedule, recompute="blocks")
        out[schedule] = {"blocks": blocks, "losses": losses, "exact": exact}
    return out


def data_parallel(rank: int, world: int) -> dict:
    """dp=world replicas (fsdp and replicate) with recompute="blocks": as one process on the whole batch."""
    return {mode: dp_workers.check_data_parallel(world, 1, 1, mode, recompute="blocks")["norms"]
            for mode in ("fsdp", "replicate")}


def _mixtral() -> torch.nn.Module:
    """A small Mixtral: its router fills an index buffer in place (``index_put_``) in the block after the one that
    makes it."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
    return transformers.MixtralForCausalLM(config)


def _mixtral_run(recompute: str) -> tuple[list[float], dict]:
    x, y = models.tokens(4, 12, 1), models.tokens(4, 12, 2)
    pm = autotp.parallelize(_mixtral(), tp=1, pp=2, example_inputs=(models.tokens(2, 12, 1),), microbatches=2,
                            schedule="gpipe", recompute=recompute)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    losses = []
    for _ in range(STEPS):
        losses.append(float(pm.step(x, target=y, loss_fn=LM_LOSS)))
        opt.step(), opt.zero_grad()
    return losses, pm.full_state_dict()


def pipeline_moe(rank: int, world: int) -> list[float]:
    """pp=world on a Mixtral: recompute="blocks" trains bit for bit as kept activations do."""
    kept_losses, kept = _mixtral_run("none")
    losses, state = _mixtral_run("blocks")
    assert losses == kept_losses, f"losses {losses} with recompute, {kept_losses} without"
    for key, want in kept.items():
        assert torch.equal(state[key], want), f"{key} differs with recompute"
    return losses
