"""TRL's fused LM head on a parallel module: the same outputs, computed from the module's logits.

TRL's ``SFTTrainer`` (1.16) replaces its model's ``forward`` with ``add_fused_lm_head``'s, which runs the model's
backbone (``model.base_model``) and projects its last hidden state through ``lm_head.weight`` in tiles, returning
per-token log-probabilities (``FusedCausalLMOutput``) instead of logits; its training loss is their negative sum. A
parallel module is the model captured whole, one graph per rank: it has neither part to call. No ``SFTConfig``
setting avoids the fused head (even the label-smoothing and ``compute_loss_func`` paths call it for their metrics).

So when TRL sets that forward on a parallel module (``TrainerFacing.__setattr__``), ``fused_forward`` takes its
place: the module's own forward gives the logits (vocab-split ones gathered, as for any caller), and the same fields
are computed from them: ``log_softmax`` at the shifted labels, the entropy, whether the label is the top logit, the
mask of scored positions, and the loss ``-sum(log_probs) / (tokens or num_items_in_batch)``. That is the fused head's
arithmetic without its tiling; the full logits are materialised (B x T x V per rank), which the fused head avoids.
"""

from __future__ import annotations

import types

import torch

from autotp.errors import InputError

_FUSED = "_fused_forward"
"""The code name of the forward TRL's ``add_fused_lm_head`` installs (in a module of the ``trl`` package)."""

_OPTIONAL = ("entropy", "is_top1", "mean_logits", "log_sum_sq_probs")
"""The fused head's optional outputs computed here (SFTTrainer asks for the first two, DPOTrainer for the first three,
and for the last with WPO weighting)."""

_NEUTRAL = {"temperature": 1.0, "logit_scale": 1.0, "final_logit_softcapping": None}
"""The fused head's logit transforms this replacement computes without (their neutral values)."""


def is_fused_head(value) -> bool:
    """Whether ``value`` is the forward TRL's ``add_fused_lm_head`` binds to a model."""
    function = getattr(value, "__func__", None)
    code = getattr(function, "__code__", None)  # its name and module are the model's forward's (functools.wraps)
    return code is not None and code.co_name == _FUSED and function.__globals__.get("__name__", "").startswith("trl.")


def _settings(function) -> dict:
    """The variables TRL's fused forward closes over (its temperature, logit scale, outputs, original forward)."""
    cells = function.__closure__ or ()
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in cells)))


def fused_forward(pm, trl_forward):
    """The forward to bind on ``pm`` in place of ``trl_forward`` (TRL's fused head, module docstring); refuses a
    fused head with a temperature, a logit scale or a softcap, or asked for fields beyond ``log_probs``, ``entropy``
    ``is_top1``, ``mean_logits`` and ``log_sum_sq_probs``, which this does not reproduce."""
    settings = _settings(trl_forward.__func__)
    odd = {k: settings.get(k, v) for k, v in _NEUTRAL.items() if settings.get(k, v) != v}
    wanted = settings.get("outputs", ("log_probs",))
    unknown = set(wanted) - {"log_probs", *_OPTIONAL}
    if unknown:
        odd["outputs"] = sorted(unknown)
    if odd:
        raise InputError(f"autotp: TRL's fused LM head with {odd} on a parallel module is not supported (it computes "
                         "the fused head's outputs from the module's logits without these transforms); use a model "
                         "whose config sets none of them, or a temperature of 1")
    output_type = trl_forward.__func__.__globals__["FusedCausalLMOutput"]
    original = settings["original_forward"]

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
        if not fused_lm_head:
            return original(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        kwargs.pop("use_cache", None)  # the parallel module keeps no cache in a training forward
        logits = getattr(original(*args, **kwargs), "logits")
        if shift_labels is None:
            logits, shift_labels = logits[:, :-1], labels[:, 1:]
        fields = per_token(logits, shift_labels, wanted)
        mask = fields["label_mask"]
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return output_type(loss=-fields["log_probs"].sum() / count, aux_loss=None, **fields)

    return types.MethodType(forward, pm)


def per_token(logits: torch.Tensor, labels: torch.Tensor, wanted=("log_probs",)) -> dict:
    """The fused head's per-token fields from ``logits`` and (already shifted) ``labels`` (-100: not scored, zero
    there): ``log_probs`` always, the optional ones (``_OPTIONAL``) when ``wanted``; the others None."""
    mask = labels != -100
    logp = torch.log_softmax(logits, dim=-1)
    fields = {"log_probs": logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0),
              "entropy": None, "log_sum_sq_probs": None, "mean_logits": None, "is_top1": None, "label_mask": mask}
    if "entropy" in wanted:
        fields["entropy"] = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0)
    if "is_top1" in wanted:
        fields["is_top1"] = (logits.argmax(-1) == labels) & mask  # bool, as TRL's kernel returns it
    # metrics and weights, without gradient (TRL's kernel marks them non-differentiable)
    if "mean_logits" in wanted:
        fields["mean_logits"] = logits.detach().float().mean(-1).masked_fill(~mask, 0)
    if "log_sum_sq_probs" in wanted:
        fields["log_sum_sq_probs"] = torch.logsumexp(2 * logp.detach().float(), -1).masked_fill(~mask, 0)
    return fields
