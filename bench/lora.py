"""A LoRA fine-tune step at tp=2 against the same step in one process, and against the base model's full fine-tune at
tp=2: step time, and bytes per rank (parameters, gradients, AdamW state, saved activations).

    python -m bench.lora

A Llama of hidden 512, 4 layers, 8 heads, vocabulary 4096, with peft's LoRA (r=16) on every projection of every
layer; batch 4 x 128 tokens; AdamW; at tp=2 without and with sequence parallelism. Ranks are CPU processes over gloo
(one thread each). The collectives of one step are counted at run time (``bench.comm``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from bench.comm import count_step
from bench.memory import SavedActivations, optimizer_bytes, tensor_bytes
from bench.ranks import run_on_ranks

RESULTS = Path(__file__).parent / "results" / "lora.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, SEQ, VOCAB, STEPS = 4, 128, 4096, 5


def _llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _adapted():
    import peft

    return peft.get_peft_model(_llama(), peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))


def _loss(out, y):
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _measure(module, step, x, y) -> dict:
    """Median step time over STEPS steps (after one warm-up), and this rank's bytes after a step."""
    trained = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4)
    times = []
    for i in range(STEPS + 1):
        start = time.perf_counter()
        step(x, y)
        opt.step()
        if i:
            times.append(time.perf_counter() - start)
        if i < STEPS:
            opt.zero_grad()
    saved = SavedActivations(list(module.parameters()))
    with saved:
        loss = _loss(module(x), y)
    loss.backward()
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    out = {"step_s": statistics.median(times), "params": tensor_bytes(module.parameters()),
           "trainable": tensor_bytes(trained), "grads": tensor_bytes(grads), "adamw": optimizer_bytes(opt),
           "activations": saved.bytes}
    out["total"] = out["params"] + out["grads"] + out["adamw"] + out["activations"]
    return out


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def one_process(rank: int, world: int) -> dict:
    """The LoRA step of the unsharded peft model."""
    model = _adapted()
    x, y = _inputs()

    def step(x, y):
        _loss(model(x), y).backward()

    return _measure(model, step, x, y)


def on_ranks(rank: int, world: int) -> dict:
    """The LoRA step and the base model's full fine-tune step at tp=world, with their collectives, without and with
    sequence parallelism."""
    import autotp

    x, y = _inputs()
    out = {}
    for name, build, sp in (("lora", _adapted, False), ("full", _llama, False), ("lora_sp", _adapted, True),
                            ("full_sp", _llama, True)):
        pm = autotp.parallelize(build(), tp=world, example_inputs=(x,), quiet=True, sequence_parallel=sp)
        out[name] = _measure(pm, lambda x, y: pm.step(x, target=y, loss_fn=_loss), x, y)
        counts = count_step(lambda: pm(x), lambda o: _loss(o, y))
        out[name]["collectives"] = {d: {op: v["count"] for op, v in per.items()} for d, per in counts.items()}
        out[name]["collective_bytes"] = {d: sum(v["bytes"] for v in per.values()) for d, per in counts.items()}
        pm.zero_grad(set_to_none=True)
    return out


def main() -> None:
    """Run both and write ``results/lora.json``."""
    single = run_on_ranks(one_process, "cpu", [1])[0]
    ranks = run_on_ranks(on_ranks, "cpu", [1, 1])
    result = {"one_process": single, "tp2_rank0": ranks[0], "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
