"""peft's and TRL's habits on a LoRA parallel module: each exact against peft on the unsharded model, or refused at
the call with what to do instead (``runtime.peft_habits``, ``runtime.trl_reference``)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import torch

import autotp
from autotp.errors import InputError, ModelPartError
from tests import capture_cache, lora_workers, models


def test_switching_off_sets_b_to_zero_and_ia3_to_one_and_refuses_what_has_no_off_value():
    from autotp.runtime.peft_habits import off_plan

    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    keys = [f"{layer}.base_layer.weight", f"{layer}.lora_A.default.weight", f"{layer}.lora_B.default.weight",
            f"{layer}.lora_B.other.weight", "base_model.model.model.embed_tokens.lora_embedding_B.default",
            f"{layer}.ia3_l.default"]
    assert off_plan(keys, ["default"]) == {keys[2]: 0.0, keys[4]: 0.0, keys[5]: 1.0}
    with pytest.raises(InputError, match="DoRA"):
        off_plan([f"{layer}.lora_magnitude_vector.default.weight"], ["default"])
    with pytest.raises(InputError, match="modules_to_save"):
        off_plan(["base_model.model.lm_head.modules_to_save.default.weight"], ["default"])


def test_one_process_habits_exact_or_refused_naming_what_to_do():
    """Adapters off (the base model's output bit for bit, in eval mode), refused in train mode with adapter dropout
    and while reading the state; the fixed adapter set; checkpointing; peft's counts."""
    import peft

    model = lora_workers.adapted(dropout=0.1)
    x = models.tokens(2, 8, 1)
    pm = autotp.parallelize(model, tp=1, example_inputs=(x,), quiet=True)
    with pm.disable_adapter():
        assert pm.adapters_disabled
        with pytest.raises(InputError, match="lora_dropout"):
            pm(x)
        with pytest.raises(InputError, match="leave the `with pm.disable_adapter"):
            pm.full_state_dict()
        pm.eval()
        with torch.no_grad(), model.eval().disable_adapter():
            assert torch.equal(pm(x).logits, model(x).logits)  # one process: the same ops, bit for bit
    assert not pm.adapters_disabled
    assert pm.get_nb_trainable_parameters() == model.get_nb_trainable_parameters()
    assert pm.active_adapters == ["default"] and pm.active_adapter == "default"
    with pytest.raises(ModelPartError, match="pm.save_pretrained"):
        peft.get_peft_model_state_dict(pm)  # it would find no adapter layer: refused, not an empty dict
    pm.set_adapter("default")  # the active set: nothing changes
    for call in (lambda: pm.set_adapter("other"), lambda: pm.add_adapter("other", None),
                 lambda: pm.delete_adapter("default")):
        with pytest.raises(InputError, match="before autotp.parallelize"):
            call()
    with pytest.raises(InputError, match="adapter_name='default'"):
        pm.load_adapter("/nonexistent", adapter_name="other")
    for call in (pm.merge_and_unload, pm.unload, pm.get_base_model):
        with pytest.raises(InputError, match="merge_adapters"):
            call()
    with pytest.raises(ModelPartError, match="add_weighted_adapter is not offered"):
        pm.add_weighted_adapter(["default"], [1.0], "mix")  # LoraModel's, which PeftModel forwards to
    assert pm.is_gradient_checkpointing is False
    with pytest.raises(InputError, match="recompute='blocks'"):
        pm.gradient_checkpointing_enable()
    pm.gradient_checkpointing_disable()
    pm.enable_input_require_grads()
    _dropout_off_and_autocast(pm.train(), model.train(), x)


def _dropout_off_and_autocast(pm, model, x) -> None:
    """TRL's disable_dropout_in_model switches the graph's dropouts off as peft's; a step under bf16 autocast is a
    bf16 rounding of peft's under the same autocast."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    trl_utils.disable_dropout_in_model(pm)
    trl_utils.disable_dropout_in_model(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine, theirs = pm(x).logits, model(x).logits
        _ce(mine, x).backward()
        _ce(theirs, x).backward()
    with torch.no_grad():
        assert torch.equal(pm(x).logits, model(x).logits)  # train mode, dropout off: bit for bit
    held = pm.state_dict(keep_vars=True)
    graded = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert graded and all(held[k].grad is not None for k in graded)
    for key, grad in graded.items():
        torch.testing.assert_close(held[key].grad, grad, rtol=2e-2, atol=2e-3)


def _ce(logits, x):
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def test_habits_at_tp_2_match_peft_and_dpo_trains_as_one_process(tmp_path):
    """On one group of 2 gloo ranks: disable_adapter, the DPO reference pattern's gradients, generation with the
    adapters off (also on a 2-stage pipeline), peft's counts, the refusals, and DPOTrainer against the unsharded peft
    model's run."""
    pytest.importorskip("trl")
    from tests import dpo_workers, peft_habit_workers
    from tests.distributed import run_on_ranks

    torch.save(dpo_workers.reference(), tmp_path / "reference.pt")
    dpo_workers.on_disk(str(tmp_path))
    lora_workers.llama().save_pretrained(tmp_path / "base")
    capture_cache.warm(lora_workers.adapted(), dpo_workers.example())
    for r in run_on_ranks(peft_habit_workers.habits, 2, str(tmp_path)):
        assert r["off"] < 1e-5 and r["off_is_base"] < 1e-5 and r["on_moved"] > 1e-2, r
        assert r["grads"] < 1e-5 and r["graded"] and r["counts"], r
        assert "leave the `with pm.disable_adapter" in r["refused_inside"], r
        assert "before autotp.parallelize" in r["set_other"] and "merge_adapters" in r["merge_and_unload"], r
        assert "ref_model=" in r["no_reference"] and "matched to the wrong rows" in r["precompute"], r
        assert r["dpo"]["worst"] < 1e-5 and r["dpo"]["moved"] > 1e-3, r
        assert r["generate"] and r["printed"] and r["pipeline_off"] < 1e-5, r


def test_fused_head_fields_equal_trls_kernel():
    """The fused head's fields computed from logits (SFTTrainer's and DPOTrainer's) are those TRL's chunked kernel
    computes from the hidden states and the head's weight."""
    kernels = pytest.importorskip("trl.kernels")
    from autotp.runtime.fused_head import per_token

    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 16), torch.randn(40, 16)
    labels = torch.randint(0, 40, (6,))
    wanted = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    theirs = kernels.ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, 8, None, 1.0, wanted[1:])
    mine = per_token(hidden @ weight.t(), labels, wanted)
    for name, value in zip(wanted, theirs):
        torch.testing.assert_close(mine[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_refusals_without_a_module_to_switch_name_what_to_do():
    """Switching adapters off or making a reference under fsdp, a reference of a module that trains nothing, and
    peft's switches on a module of a model peft did not adapt: each an ``InputError`` saying what to use."""
    from types import SimpleNamespace

    from autotp.runtime.peft_habits import PeftHabits
    from autotp.runtime.reference_model import reference_model

    fsdp = SimpleNamespace(dp=2, dp_mode="fsdp")

    class Sharded(PeftHabits):
        peft, options = object(), fsdp

    with pytest.raises(InputError, match="dp_mode='replicate'"):
        Sharded().disable_adapter_layers()
    with pytest.raises(InputError, match="reference_model\\(\\) under dp_mode='fsdp'.*dp_mode='replicate'"):
        reference_model(SimpleNamespace(options=fsdp, parameters=lambda: iter(())))
    x = models.tokens(2, 8, 1)
    pm = autotp.parallelize(lora_workers.llama(), tp=1, example_inputs=(x,), quiet=True)
    with pytest.raises(InputError, match="needs a peft model: parallelize the model peft.get_peft_model returned"):
        pm.disable_adapter_layers()
    for p in pm.parameters():
        p.requires_grad_(False)
    with pytest.raises(InputError, match="nothing in this module trains"):
        reference_model(pm)
