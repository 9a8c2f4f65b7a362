"""autotp against the real thing: NVIDIA megatron-core's own tensor parallelism, on megatron-core's GPTModel.

    pip install --no-deps --ignore-requires-python megatron-core==0.19.2 && pip install triton numpy packaging
    python -m bench.megatron_core [--rounds 15]

An optional baseline (never needed by the tests; the facts and CPU workarounds are in
shared/reference/megatron-core-on-cpu.md). Two gloo ranks on the CPU, one thread each. megatron-core's
``GPTModel`` is built twice from the same seed with CPU initialisation (so both hold the same master weights):
at tensor-parallel size 1, an ordinary unparallelised transformer that autotp captures and shards at tp=2,
and at size 2, megatron-core's own Megatron split. Both train on the vocab-parallel cross-entropy. Their losses
must agree before anything is timed. In the same run, the example GPT of the same shape (examples.gpt) is
parallelized by autotp and split by the hand-written Megatron (bench.megatron, vocab-parallel loss). One training
step of each of the four (forward, loss, backward) takes turns, order rotated; a step's time is the slower rank's.
Ratios are medians of per-round ratios, 95% intervals: autotp / megatron-core on GPTModel, autotp / hand-written
Megatron on the example GPT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import autotp
from autotp.runtime.data_parallel import local
from bench.runtime import alternate, two_rank_command
from bench.stats import paired_ratio, summary, with_interval

LAYERS, HIDDEN, HEADS, VOCAB, BATCH, SEQ = 4, 256, 8, 8192, 4, 128
RESULTS = Path(__file__).parent / "results" / "megatron_core.json"


def _megatron_core():
    """The modules used, imported late: megatron-core is optional."""
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        raise SystemExit(f"megatron-core is not installed ({e}); see this module's docstring for the install") from e
    return parallel_state, tensor_parallel, GPTModel, get_gpt_layer_local_spec, TransformerConfig


def _build(tp: int) -> nn.Module:
    """megatron-core's GPTModel at tensor-parallel size ``tp``, from seed 0 (CPU init: the same master weights)."""
    parallel_state, tensor_parallel, GPTModel, layer_spec, TransformerConfig = _megatron_core()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # CPU: no fork
    # CPU workaround: attention's scratch buffer would be allocated on CUDA; give it a CPU one.
    parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float32)] = torch.empty(
        BATCH * HEADS // tp * SEQ * SEQ)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               tensor_model_parallel_size=tp, use_cpu_initialization=True,
                               perform_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0)
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=layer_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, parallel_output=True, position_embedding_type="learned_absolute")


class CausalLM(nn.Module):
    """A GPTModel as an ordinary language model: token ids in, logits (batch, seq, vocab) out, or with
    ``labels`` its per-token loss. It supplies the positions and an explicit causal mask (on CPU the model
    would build its default mask on CUDA)."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.gpt = gpt
        self.register_buffer("mask", torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1),
                             persistent=False)

    def forward(self, input_ids, labels=None):
        seq = input_ids.shape[1]
        positions = torch.arange(seq).unsqueeze(0).expand_as(input_ids)
        return self.gpt(input_ids, positions, self.mask[..., :seq, :seq], labels=labels)


def _hand_written_steps(x, y, world: int) -> dict:
    """A step of autotp and of the hand-written Megatron on the example GPT of this shape (bench.runtime's pair)."""
    from bench.megatron import MegatronGPT
    from examples.gpt import build_gpt

    torch.manual_seed(0)
    gpt = build_gpt(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, block_size=SEQ)
    pm = autotp.parallelize(gpt, tp=world, example_inputs=(x,), vocab="split", quiet=True)
    hand = MegatronGPT(gpt, None)

    def autotp_step():
        pm.step(x, target=y)
        for p in pm.parameters():
            p.grad = None

    def hand_step():
        hand(x, y).backward()
        for p in hand.parameters():
            p.grad = None
    return {"autotp (example GPT)": autotp_step, "hand-written Megatron": hand_step}


def _measure(rank: int, world: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2))
    whole = CausalLM(_build(1))  # captured now, while megatron-core's parallel state says tp=1
    pm = autotp.parallelize(whole, tp=world, example_inputs=x, quiet=True)
    own = CausalLM(_build(world))  # megatron-core's own tp=world split of the same master weights
    auto_loss = pm.loss(x, target=y)
    core_loss = own(x, labels=y).mean()
    if abs(auto_loss.item() - core_loss.item()) > 1e-4 * abs(core_loss.item()):
        raise RuntimeError(f"autotp's loss {auto_loss.item()} differs from megatron-core's {core_loss.item()}")

    def autotp_step():
        pm.step(x, target=y)
        for p in pm.parameters():
            p.grad = None

    def core_step():
        own(x, labels=y).mean().backward()
        for p in own.parameters():
            p.grad = None

    samples = alternate({"autotp": autotp_step, "megatron-core": core_step} | _hand_written_steps(x, y, world), rounds)
    split = sum(p.is_split for p in pm.plan.placements.values())
    return {"times": {k: summary(v) for k, v in samples.items()},
            "autotp / megatron-core": paired_ratio(samples["autotp"], samples["megatron-core"]),
            "autotp / hand-written Megatron": paired_ratio(samples["autotp (example GPT)"],
                                                           samples["hand-written Megatron"]),
            "losses": [auto_loss.item(), core_loss.item()],
            "split": f"{split}/{len(pm.plan.placements)} parameters split", "notes": list(pm.plan.notes),
            "params per rank": {"autotp": sum(local(p).numel() for p in pm.parameters()),
                                "megatron-core": sum(p.numel() for p in own.parameters())}}


def main(argv=None) -> int:
    """Measure, print, write ``bench/results/megatron_core.json``."""
    _megatron_core()  # fail early, with the install line, when it is missing
    r = two_rank_command(_measure, __doc__, RESULTS, argv)
    ratio, times = r["autotp / megatron-core"], r["times"]
    print(f"megatron-core GPTModel {LAYERS} x {HIDDEN}, vocabulary {VOCAB}, batch {BATCH} x {SEQ}, tp=2: "
          f"autotp {times['autotp']['median'] * 1e3:.1f} ms, megatron-core {times['megatron-core']['median'] * 1e3:.1f}"
          f" ms per step; autotp / megatron-core {with_interval(ratio)}; on the example GPT autotp / hand-written "
          f"Megatron {with_interval(r['autotp / hand-written Megatron'])}; "
          f"losses {r['losses']}; autotp {r['split']}; parameters per rank {r['params per rank']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
