"""Per-rank bodies of the LoRA tests on gloo: a peft-adapted Llama trained with AdamW at tp (and tp x pp) exactly as
one process trains it, its frozen base without gradients or optimizer state, and its collectives counted at run time
against the base model's."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from bench.comm import CommBytes
from tests import models
from tests.checkpoint_workers import ADAM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 4
STEPS = 2
SEED = 1234
CLIP = 0.05
"""Below the adapters' gradient norm, so every step clips: a norm counting a share or a frozen weight would show."""


def llama(layers: int = 2):
    """The tiny Llama (4 heads, 2 KV heads), seeded."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def adapted(dropout: float = 0.0, layers: int = 2, targets=TARGETS):
    """The tiny Llama with LoRA on ``targets`` (peft), B drawn at random so that the adapters change the output."""
    import peft

    model = peft.get_peft_model(llama(layers), peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=list(targets),
                                                               lora_dropout=dropout))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name or "lora_embedding" in name:  # peft starts an embedding's A at zero: draw it too
            torch.nn.init.normal_(p, std=0.05)
    return model


def _loss(out, target):
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _events(run) -> list[tuple[str, int]]:
    """The collectives ``run()`` dispatches, each as (collective, bytes)."""
    with CommDebugMode(), CommBytes() as seen:
        run()
    return seen.events


def counted(pm, x, y, step: bool = False) -> dict:
    """The collectives of one training step, forward and backward apart; with ``step``, then one SGD step of
    learning rate 1 on the parameters that train, and the loss."""
    holder = {}
    forward = _events(lambda: holder.setdefault("loss", _loss(pm(x), y)))
    backward = _events(lambda: holder["loss"].backward())
    if step:
        torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=1.0).step()
    for p in pm.parameters():
        p.grad = None
    return {"forward": forward, "backward": backward, "loss": holder["loss"].item()}


def collectives(rank: int, world: int) -> dict:
    """Run-time collectives of a training step of the adapted model and of its base model alone, at tp=world."""
    x, y = models.tokens(2, 8, 1), models.tokens(2, 8, 2)
    pm = autotp.parallelize(adapted(), tp=world, example_inputs=(x,), quiet=True)
    base = autotp.parallelize(llama(), tp=world, example_inputs=(x,), quiet=True)
    return {"adapted": counted(pm, x, y), "base": counted(base, x, y)}


def bucket_bytes(pm) -> int:
    """Bytes of this rank's adapter weights read through ``GradSum`` (whose gradient shares the bucket sums)."""
    from autotp.rewrite.grad_bucket import GradSum

    total = 0
    for gm in pm.rank_modules():
        for node in gm.graph.nodes:
            if node.op == "call_module" and isinstance(gm.get_submodule(node.target), GradSum):
                param = gm.get_parameter(node.args[0].target)  # whole on every rank: its local tensor is all of it
                total += param.numel() * param.element_size()
    return total


def training(rank: int, world: int, tp: int, pp: int, dropout: float, dp: int = 1, mode: str = "replicate") -> dict:
    """AdamW steps, clipped, of the adapted model at tp x pp (x dp replicas, each its slice of the batch) against one
    process seeded alike: losses, every parameter after the steps; the frozen base weights get no gradient and no
    optimizer state; the all-reduces of the first step (their bytes) and the size of this rank's gradient bucket."""
    model = adapted(dropout).train()
    ref = copy.deepcopy(model)
    x, y = models.tokens(4, 8, 1), models.tokens(4, 8, 2)
    settings = {"dp": dp, "dp_mode": mode} if dp > 1 else {}
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs=(x,), quiet=True, **settings)
    mine = slice(pm.dp_rank * len(x) // dp, (pm.dp_rank + 1) * len(x) // dp)
    torch.manual_seed(100 + rank)  # the ranks' global generators differ: dropout must not depend on them
    pm.manual_seed(SEED)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], **ADAM)
    losses, norms, reduces, events = [], [], None, None
    for _ in range(STEPS):
        with CommBytes() as seen:
            loss = pm.step(x[mine], target=y[mine], loss_fn=_loss)
        reduces = [n for what, n in seen.events if what == "all_reduce"] if reduces is None else reduces
        events = seen.events if events is None else events
        losses.append(float(loss) if loss is not None else None)
        frozen_grads = [n for n, p in pm.named_parameters() if not p.requires_grad and p.grad is not None]
        norms.append(float(pm.clip_grad_norm_(CLIP)))
        opt.step(), opt.zero_grad()
    torch.manual_seed(SEED)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAM)
    ref_losses = []
    for _ in range(STEPS):
        loss = _loss(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], CLIP)
        ref_opt.step(), ref_opt.zero_grad()
        ref_losses.append(loss.item())
    base = step_collectives(llama(), x[mine], y[mine], tp=tp, pp=pp, **settings) if mode == "fsdp" else None
    full = pm.full_state_dict()
    want = ref.state_dict()
    worst = max((full[k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point())
    moved = max((full[k] - v).abs().max().item() for k, v in adapted(dropout).state_dict().items()
                if "lora_" in k)
    state = {id(p) for p in opt.state}
    frozen_state = [n for n, p in pm.named_parameters() if not p.requires_grad and id(p) in state]
    frozen_params = sum(1 for p in pm.parameters() if not p.requires_grad)
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "worst": worst, "moved": moved,
            "frozen_grads": frozen_grads, "frozen_state": frozen_state, "frozen_params": frozen_params,
            "rank": dist.get_rank(), "reduces": reduces, "bucket": bucket_bytes(pm), "trained": trained_bytes(pm),
            "kinds": kinds(events), "base_kinds": base}


def other_steps(kind: str, tp: int, pp: int) -> dict:
    """AdamW steps of IA3 (``kind`` "ia3") or DoRA ("dora") on all seven projections at tp x pp against one
    process: the worst parameter difference after them, how far the adapters moved, and the bytes of each
    all-reduce of the first step."""
    import peft

    config = peft.IA3Config(target_modules=TARGETS, feedforward_modules=["down_proj"]) if kind == "ia3" else \
        peft.LoraConfig(r=RANK, target_modules=TARGETS, use_dora=True)
    model = peft.get_peft_model(llama(), config)
    torch.manual_seed(1)
    for p in (p for p in model.parameters() if p.requires_grad):
        torch.nn.init.normal_(p, mean=1.0 if kind == "ia3" else 0.0, std=0.05)
    ref, start = copy.deepcopy(model).train(), copy.deepcopy(model.state_dict())
    x, y = models.tokens(4, 8, 1), models.tokens(4, 8, 2)
    pm = autotp.parallelize(model.train(), tp=tp, pp=pp, example_inputs=(x,), quiet=True)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], **ADAM)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAM)
    reduces = None
    for _ in range(STEPS):
        with CommBytes() as seen:
            pm.step(x, target=y, loss_fn=_loss)
        reduces = [n for what, n in seen.events if what == "all_reduce"] if reduces is None else reduces
        opt.step(), opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step(), ref_opt.zero_grad()
    full, want = pm.full_state_dict(), ref.state_dict()
    worst = max((full[k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point())
    moved = max((want[k] - start[k]).abs().max().item() for k in want if "ia3_l" in k or "lora_" in k)
    return {"worst": worst, "moved": moved, "reduces": reduces}


def trainings(rank: int, world: int, tp: int, pp: int, dropout: float, dp: int, modes: tuple[str, ...]) -> dict:
    """``training`` under each data-parallel mode of ``modes``, in one group of ranks; with fsdp at pp=1,
    ``lora_cast_workers.fsdp_cast`` too; at tp=2 x pp=2, ``pipeline_counts`` and ``inner_cut_workers.inner_cuts``
    too; under a pipeline without replicas or dropout, ``other_steps`` of IA3 and DoRA."""
    out = {"runs": [training(rank, world, tp, pp, dropout, dp, mode) for mode in modes]}
    if pp > 1 and dp == 1 and not dropout:  # IA3 and DoRA on all seven projections
        out.update(ia3=other_steps("ia3", tp, pp), dora=other_steps("dora", tp, pp))
    if "fsdp" in modes and pp == 1:
        from tests.lora_cast_workers import fsdp_cast

        out["cast"] = fsdp_cast(tp, dp)
    if pp == 2 and tp == 2 and dp == 1:
        from tests.inner_cut_workers import inner_cuts  # it reads this module's model

        out["pipelines"] = pipeline_counts(rank, world)
        out["inner_cuts"] = inner_cuts(rank, world)
    return out


def kinds(events: list[tuple[str, int]]) -> dict[str, int]:
    """How many collectives of each kind ``events`` (collective, bytes) holds."""
    out: dict[str, int] = {}
    for what, _ in events:
        out[what] = out.get(what, 0) + 1
    return out


def step_collectives(model, x, y, **settings) -> dict[str, int]:
    """``kinds`` of the collectives of one ``pm.step`` of ``model`` (every parameter trained: a full fine-tune)
    parallelized with ``settings``."""
    pm = autotp.parallelize(model, example_inputs=(x,), quiet=True, **settings)
    with CommBytes() as seen:
        pm.step(x, target=y, loss_fn=_loss)
    return kinds(seen.events)


def trained_bytes(pm) -> int:
    """Bytes of this rank's parts of the parameters that train."""
    from torch.distributed.tensor import DTensor

    held = [p.to_local() if isinstance(p, DTensor) else p for p in pm.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in held)


def _logits(out):
    return getattr(out, "logits", out)


def peft_files(rank: int, world: int, folder: str) -> dict:
    """save_pretrained writes what PeftModel.from_pretrained loads on the unsharded base with the same outputs; an
    adapter peft saved (one process) loads into the parallel module; merging on the parallel module computes what
    peft's merge_and_unload does; generation with adapters equals peft's."""
    import peft

    x = models.tokens(2, 8, 1)
    model = adapted().eval()
    pm = autotp.parallelize(model, tp=world, example_inputs=(x,), quiet=True).eval()
    out = {"forward": (_logits(pm(x)) - _logits(model(x))).abs().max().item()}
    ours, theirs = f"{folder}/ours", f"{folder}/theirs"
    pm.save_pretrained(ours)  # complete on every rank when it returns
    loaded = peft.PeftModel.from_pretrained(llama(), ours).eval()
    out["saved"] = (_logits(loaded(x)) - _logits(model(x))).abs().max().item()
    other = adapted()
    torch.manual_seed(7)
    for name, p in other.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.05)
    if rank == 0:
        other.save_pretrained(theirs)
    dist.barrier()
    pm.load_adapter(theirs)
    out["loaded"] = (_logits(pm(x)) - _logits(other.eval()(x))).abs().max().item()
    ids = models.tokens(1, 5, 3)
    got = pm.generate(ids, max_new_tokens=6, do_sample=False)
    want = other.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    out["generate"] = bool(torch.equal(got, want))
    pm.merge_adapters()
    merged = other.merge_and_unload().eval()
    out["merged"] = (_logits(pm(x)) - _logits(merged(x))).abs().max().item()
    full = pm.full_state_dict()
    out["merged_weights"] = max((full[f"base_model.model.{k}".replace(".weight", ".base_layer.weight")] - v).abs().max()
                                .item() for k, v in merged.state_dict().items() if "layers.0.self_attn.q_proj" in k)
    return out


class BiasedMlp(torch.nn.Module):
    """Token embedding, then blocks ``x + down(gelu(up(x)))`` of ``nn.Linear`` layers with biases: the row-split
    ``down`` adds its bias after its one all-reduce, which its adapter's partial sum must join."""

    def __init__(self, layers: int = 2, dim: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(models.VOCAB, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"up": torch.nn.Linear(dim, 2 * dim),
                                                                "down": torch.nn.Linear(2 * dim, dim)})
                                          for _ in range(layers))
        self.head = torch.nn.Linear(dim, models.VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block["down"](torch.nn.functional.gelu(block["up"](x)))
        return self.head(x)


def biased_bases() -> dict:
    """GPT-2 (``Conv1D``) and ``BiasedMlp`` (``nn.Linear``), biases drawn non-zero (GPT-2 starts them at zero, where a
    bias added tp times would not show), with the peft targets and the hidden size of each."""
    out = {"gpt2": (models.build("hf_gpt2"), ["c_attn", "c_proj", "c_fc"], 64),
           "linear": (BiasedMlp(), ["up", "down"], 32)}
    torch.manual_seed(2)
    for model, *_ in out.values():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.1)
    return out


def against_one_process(model, base, world: int, hidden: int, **settings) -> dict:
    """The run-time collectives of a training step of the adapted ``model`` and of its ``base`` model alone at
    tp=world (``settings``: more ``autotp.parallelize`` options), the largest difference from one process of the loss
    and of every parameter after one SGD step of learning rate 1 (so: of every gradient), this rank's bucket, and the
    bytes of one activation (2 x 8 tokens of ``hidden`` features, float32)."""
    x, y = models.tokens(2, 8, 1), models.tokens(2, 8, 2)
    ref = copy.deepcopy(model)
    pm = autotp.parallelize(model, tp=world, example_inputs=(x,), quiet=True, **settings)
    counts = {"adapted": counted(pm, x, y, step=True),
              "base": counted(autotp.parallelize(base, tp=world, example_inputs=(x,), quiet=True, **settings), x, y)}
    ref_loss = _loss(ref(x), y)
    ref_loss.backward()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=1.0).step()
    full = pm.full_state_dict()
    worst = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items() if v.is_floating_point())
    return {**counts, "loss": abs(counts["adapted"]["loss"] - ref_loss.item()), "worst": worst,
            "bucket": bucket_bytes(pm), "activation": 2 * 8 * hidden * 4}


def biased_rows(rank: int, world: int) -> dict:
    """``against_one_process`` for each of ``biased_bases``, with LoRA on every projection and the biases trained too
    (peft's ``bias="all"``)."""
    import peft

    out = {}
    for name, (base, targets, hidden) in biased_bases().items():
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=RANK, target_modules=targets, bias="all"))
        torch.manual_seed(1)
        for key, p in model.named_parameters():
            if "lora_B" in key:
                torch.nn.init.normal_(p, std=0.05)
        out[name] = against_one_process(model, base, world, hidden)
    return out


def sequence_parallel(rank: int, world: int) -> dict:
    """``against_one_process`` under sequence parallelism for the tiny Llama with LoRA on all seven projections, and
    for GPT-2 (``Conv1D``: tokens flattened to ``[B*T, C]``, biases drawn) with LoRA on c_attn, c_proj and c_fc."""
    import peft

    base, targets, hidden = biased_bases()["gpt2"]
    gpt2 = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=RANK, target_modules=targets, fan_in_fan_out=True))
    torch.manual_seed(1)
    for key, p in gpt2.named_parameters():
        if "lora_B" in key:
            torch.nn.init.normal_(p, std=0.05)
    return {"llama": against_one_process(adapted(), llama(), world, 64, sequence_parallel=True),
            "gpt2": against_one_process(gpt2, base, world, hidden, sequence_parallel=True)}


PIPELINES = (("gpipe", 2), ("1f1b", 4))
"""(schedule, microbatches) of ``pipeline_counts``."""


def pipeline_counts(rank: int, world: int, layouts=PIPELINES, layers: int = 2) -> list[dict]:
    """At tp=2 x pp=2, for each (schedule, microbatches) of ``layouts``: one ``pm.step`` of the adapted model (of
    ``layers`` layers; above 2, a stage per layer), then an SGD step of learning rate 1, against one process (the
    largest difference of any parameter, so of any gradient); the step's collectives by kind and its all-reduces'
    bytes, and those of the base model's full fine-tune laid out alike; whether this rank holds the first stage, this
    rank's bucket and one microbatch's activation in bytes."""
    out = []
    x, y = models.tokens(4, 8, 1), models.tokens(4, 8, 2)
    cuts = [f"model.layers.{i}" for i in range(1, layers)] if layers > 2 else []
    for schedule, micro in layouts:
        model = adapted(layers=layers).train()
        ref = copy.deepcopy(model)
        settings = {"tp": 2, "pp": 2, "schedule": schedule, "microbatches": micro}
        pm = autotp.parallelize(model, example_inputs=(x,), quiet=True, cuts=[f"base_model.model.{c}" for c in cuts],
                                **settings)
        with CommBytes() as seen:
            pm.step(x, target=y, loss_fn=_loss)
        torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=1.0).step()
        _loss(ref(x), y).backward()
        torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=1.0).step()
        full = pm.full_state_dict()
        worst = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items() if v.is_floating_point())
        out.append({"schedule": schedule, "worst": worst, "kinds": kinds(seen.events),
                    "reduces": [n for what, n in seen.events if what == "all_reduce"],
                    "base_kinds": step_collectives(llama(layers), x, y, cuts=cuts, **settings), "first": pm.holds_first,
                    "bucket": bucket_bytes(pm), "activation": len(x) // micro * 8 * 64 * 4})
    return out
