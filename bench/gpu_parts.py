"""The parts of the device check (``bench.gpu``): each a function of (device, small) returning JSON-able figures.

Every figure compares autotp with the unsharded model on the same device: the checker's one-step comparison,
training steps (fp32 and a bf16 policy) and their times, greedy generation (tokens and speed) against
transformers' ``generate``, and a two-rank run (NCCL on two GPUs; gloo on the CPU). ``small`` shrinks every model
and count to a CPU smoke test's size.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

import autotp

ADAM = {"lr": 1e-3}
STEPS = 5
"""AdamW steps compared per run (the parameters after them must equal the unsharded model's)."""


def sync(device: str) -> None:
    """Wait for the device's queued kernels (CUDA launches are asynchronous: a time read without it measures the
    launch, not the work)."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(run, device: str, rounds: int) -> float:
    """Median milliseconds of ``run()`` over ``rounds`` calls after one warm-up call."""
    run()
    times = []
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def gpt_setup(device: str, small: bool):
    """The example GPT (seeded, on the CPU: each side copies it to ``device``) and one batch (ids, targets)."""
    from examples.gpt import build_gpt

    torch.manual_seed(0)
    if small:
        model, shape, vocab = build_gpt(), (2, 16), 64
    else:
        model, shape, vocab = build_gpt(n_layer=4, n_embd=1024, n_head=16, vocab_size=32000, block_size=512), \
            (8, 512), 32000
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, vocab, shape, generator=gen) for _ in range(2))
    return model, x.to(device), y.to(device)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position (fp32 whatever the logits' dtype, as autocast computes it)."""
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _autocast(device: str, policy: bool):
    """bf16 autocast on ``device``'s type ("cuda:1" autocasts as "cuda") with ``policy``, else none."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=policy)


def unsharded_training(model, x, y, device: str, policy: bool, steps: int):
    """``steps`` AdamW steps of the unsharded ``model`` (bf16 autocast with ``policy``): its losses and state."""
    opt, losses = torch.optim.AdamW(model.parameters(), **ADAM), []
    for _ in range(steps):
        with _autocast(device, policy):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def parallel_training(pm, x, y, steps: int, clip: float | None = None) -> list[float]:
    """``steps`` AdamW steps of a parallel module (torch's own clipping over its DTensor parameters with
    ``clip``): its losses."""
    opt, losses = torch.optim.AdamW(pm.parameters(), **ADAM), []
    for _ in range(steps):
        losses.append(pm.step(x, target=y, loss_fn=lm_loss).item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(pm.parameters(), clip)
        opt.step(), opt.zero_grad()
    return losses


def max_diff(full: dict, want: dict) -> float:
    """The largest absolute difference between two state dicts' common tensors."""
    return max(float((full[k].float().cpu() - want[k].float().cpu()).abs().max()) for k in want if k in full)


def rms_diff(full: dict, want: dict) -> float:
    """The root-mean-square difference over the common tensors (bf16 runs: one rounding step is the max)."""
    keys = [k for k in want if k in full]
    squares = sum(float(((full[k].double().cpu() - want[k].double().cpu()) ** 2).sum()) for k in keys)
    return (squares / sum(want[k].numel() for k in keys)) ** 0.5


def against_unsharded(pm, losses: list[float], want_losses: list[float], want: dict) -> dict:
    """How far a parallel module's training went from the unsharded model's: losses and parameters after it."""
    full = pm.full_state_dict()
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, want_losses)),
            "param_max_diff": max_diff(full, want), "param_rms_diff": rms_diff(full, want)}


def step_of(pm, x, y):
    """One timed training step of ``pm`` (forward, backward; gradients dropped so none accumulate)."""
    def pm_step():
        pm.step(x, target=y, loss_fn=lm_loss)
        for p in pm.parameters():
            p.grad = None
    return pm_step


def checker(device: str, small: bool) -> dict:
    """``autotp.check`` at tp=2 (every rank simulated in this process) on the device: one training step compared
    with the unsharded model (output, loss, gradients, parameters after SGD), in fp32 and bf16."""
    from devtools.tiny import quiet
    from devtools.zoo import entries
    from bench.one_gpu import DTYPES, check_one

    models = {"examples/gpt.py:build_gpt"} | (set() if small else {"llama", "qwen3_moe"})
    rows = []
    for entry in entries(only=models):
        for dtype in ("fp32",) if small else ("fp32", "bf16"):
            with quiet():
                row = check_one(entry, 2, DTYPES[dtype], torch.device(device))
            rows.append({"model": entry.name, "dtype": dtype, **{k: row.get(k) for k in
                                                                 ("verdict", "max_error", "seconds")}})
    return {"rows": rows}


def single(device: str, small: bool) -> dict:
    """tp=1 on one device: AdamW steps of the parallel module against the unsharded model, in fp32 and under a
    bf16 policy (``MixedPrecision``: bf16 compute over fp32 master weights), and the time of a step of each."""
    model, x, y = gpt_setup(device, small)
    found = {}
    for policy in (False, True):
        kind = "bf16_policy" if policy else "fp32"
        ref = copy.deepcopy(model).to(device)
        pm = autotp.parallelize(copy.deepcopy(model).to(device), tp=1, example_inputs=(x,), quiet=True,
                                mixed_precision=torch.bfloat16 if policy else None)
        losses = parallel_training(pm, x, y, STEPS)
        want_losses, want = unsharded_training(ref, x, y, device, policy, STEPS)
        found[kind] = against_unsharded(pm, losses, want_losses, want)
        pm_step = step_of(pm, x, y)

        def ref_step():
            with _autocast(device, policy):
                loss = lm_loss(ref(x), y)
            loss.backward()
            ref.zero_grad(set_to_none=True)  # a plain module's own

        rounds = 3 if small else 20
        found[kind]["step_ms"] = timed_ms(pm_step, device, rounds)
        found[kind]["unsharded_step_ms"] = timed_ms(ref_step, device, rounds)
    found["bf16_policy"]["unsharded_bf16_vs_fp32_rms"] = policy_gap(model, x, y, device, unsharded_training)
    return found


def policy_gap(model, x, y, device: str, train) -> float:
    """The unsharded model's own bf16-vs-fp32 gap after the same steps (RMS over the parameters): what a bf16
    policy's difference from the unsharded run under that policy is judged against."""
    _, fp32 = train(copy.deepcopy(model).to(device), x, y, device, False, STEPS)
    _, bf16 = train(copy.deepcopy(model).to(device), x, y, device, True, STEPS)
    return rms_diff(bf16, fp32)


def llama(small: bool):
    """A Llama with random weights, in eval mode (as ``from_pretrained`` returns it): the tests' 2-layer one, or
    bench.generation's of about 400 MB."""
    if small:
        from tests.generation_workers import _small

        return _small("llama", 2).eval(), 128
    from bench.generation import build

    return build(), 16000


def generation(device: str, small: bool) -> dict:
    """Greedy generation at tp=1 against transformers' ``model.generate`` on the device: tokens equal, what
    ``parallelize`` and the first generate cost, and decode tokens/s of each side at batch 1 and 8."""
    model, vocab = llama(small)
    model.generation_config.eos_token_id = None  # every sequence runs all the new tokens on both sides
    model = model.to(device)
    new, prompt = (4, 6) if small else (64, 128)
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(2)).to(device)
    sync(device)
    start = time.perf_counter()
    pm = autotp.parallelize(model, tp=1, example_inputs=(ids,), quiet=True)
    found = {"parallelize_s": round(time.perf_counter() - start, 3)}
    start = time.perf_counter()
    pm.generate(ids, max_new_tokens=1)
    sync(device)
    found["first_generate_s"] = round(time.perf_counter() - start, 3)
    for batch in (1, 8):
        prompts = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch)).to(device)
        row = {}
        for side, generate in (("autotp", pm.generate), ("transformers", model.generate)):
            def run(n):
                with torch.inference_mode():
                    return generate(prompts, max_new_tokens=n, do_sample=False)
            prefill_ms = timed_ms(lambda: run(1), device, 2 if small else 5)
            total_ms = timed_ms(lambda: run(new), device, 2 if small else 5)
            row[f"{side}_tokens_per_s"] = round(batch * (new - 1) / max(total_ms - prefill_ms, 1e-6) * 1e3, 1)
            row[f"{side}_prefill_ms"] = prefill_ms
            row[f"{side}_tokens"] = run(new)
        row["same_tokens"] = bool(torch.equal(row.pop("autotp_tokens"), row.pop("transformers_tokens")))
        found[f"batch_{batch}"] = row
    return found


def ranks(device: str, small: bool, limit_s: float) -> dict:
    """tp=2 on two ranks (NCCL on two GPUs, gloo on the CPU): AdamW steps with torch's clipping against the
    unsharded model, in fp32 and under a bf16 policy, step times, and greedy generation against
    ``model.generate``. Skipped, saying so, where fewer than two GPUs exist."""
    from bench import ranks as spawn

    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
    threads = [1, 1] if device == "cpu" else [0, 0]
    results = spawn.run_on_ranks(two_ranks, device, threads, device, small, limit_s=limit_s)
    return {f"rank{r}": result for r, result in enumerate(results)}


def two_ranks(rank: int, world: int, device: str, small: bool) -> dict:
    """One rank's body of ``ranks``."""
    model, x, y = gpt_setup(device, small)
    here = f"cuda:{rank}" if device == "cuda" else "cpu"
    x, y = x.to(here), y.to(here)
    found = {}
    for policy in (False, True):
        kind = "bf16_policy" if policy else "fp32"
        pm = autotp.parallelize(copy.deepcopy(model), tp=world, example_inputs=(x.cpu(),), quiet=True,
                                mixed_precision=torch.bfloat16 if policy else None)
        losses = parallel_training(pm, x, y, STEPS, clip=1.0)
        ref = copy.deepcopy(model).to(here)
        want_losses, want = _unsharded_clipped(ref, x, y, here, policy)
        found[kind] = against_unsharded(pm, losses, want_losses, want)
        pm_step = step_of(pm, x, y)

        found[kind]["step_ms"] = timed_ms(pm_step, device, 3 if small else 20)
    found["bf16_policy"]["unsharded_bf16_vs_fp32_rms"] = policy_gap(model, x, y, here, _unsharded_clipped)
    found["generation"] = _generation_at_tp(world, here, small)
    return found


def _unsharded_clipped(model, x, y, device: str, policy: bool, steps: int = STEPS):
    """``unsharded_training`` with the gradient norm clipped to 1.0 before each step, as ``two_ranks`` does."""
    opt, losses = torch.optim.AdamW(model.parameters(), **ADAM), []
    for _ in range(steps):
        with _autocast(device, policy):
            loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _generation_at_tp(world: int, here: str, small: bool) -> dict:
    """Greedy tokens of the parallel module at tp=``world`` against ``model.generate`` on this rank's device."""
    model, vocab = llama(small)
    ids = torch.randint(0, vocab, (2, 6 if small else 64), generator=torch.Generator().manual_seed(3))
    pm = autotp.parallelize(model, tp=world, example_inputs=(ids,), quiet=True)
    ids = ids.to(here)
    model = model.to(here)
    new = 4 if small else 32
    out = pm.generate(ids, max_new_tokens=new, do_sample=False)
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=new, do_sample=False)
    return {"same_tokens": bool(torch.equal(out.to(ref.device), ref))}
