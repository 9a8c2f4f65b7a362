"""TRL's preference trainers (DPOTrainer) on a parallel module: the reference model they would make by themselves,
refused where it is not the one they make for the unsharded model.

TRL decides how to get the reference log-probs from ``is_peft_model(model)``, an ``isinstance`` check that a parallel
module of a peft model fails. With ``ref_model=None`` it then

- loads the base model from ``config._name_or_path`` as the reference, where for the unsharded ``PeftModel`` it
  would use a frozen copy of the adapter as it starts (``add_adapter("ref")``): another reference as soon as the
  adapter is not freshly zero-initialised (and, for a model built from a config, no path to load);
- or, with ``precompute_ref_log_probs=True``, computes them with the module before training, gathering each batch's
  values over every process (``gather_for_metrics``): the tensor-parallel ranks of one replica read the same
  batch, so each value is gathered tp times and the values are matched to the wrong rows.

Both are refused when the trainer is built (it adds its tags to the model first thing it does with it), naming the
exact way: ``ref_model=pm.reference_model()`` (``runtime.reference_model``).
"""

from __future__ import annotations

from autotp.errors import InputError

_EXACT = ("pass ref_model=pm.reference_model() (made before training: the module with frozen copies of its "
          "adapters, as TRL's frozen copy of the adapter for the unsharded peft model, sharing the base's shards): "
          "the reference log-probs are then those TRL computes for the unsharded model")


def check_reference(pm, trainer_locals: dict) -> None:
    """Refuse the reference a TRL trainer being built (its ``__init__``'s locals) would make for ``pm`` by itself
    when it is not the unsharded model's (module docstring); nothing for other trainers."""
    trainer = trainer_locals.get("self")
    args = getattr(trainer, "args", None)
    if args is None or not hasattr(args, "precompute_ref_log_probs") or "ref_model" not in trainer_locals:
        return
    if trainer_locals["ref_model"] is not None:
        return
    name = type(trainer).__name__
    if args.precompute_ref_log_probs and pm.options.tp > 1:
        raise InputError(f"{name}(precompute_ref_log_probs=True) on a parallel module at tp={pm.options.tp}: TRL "
                         "gathers the precomputed reference log-probs over every process, so each is gathered once "
                         "per tensor-parallel rank and matched to the wrong rows. Set precompute_ref_log_probs=False "
                         f"and {_EXACT}")
    if not args.precompute_ref_log_probs and getattr(pm, "peft", None) is not None:
        raise InputError(f"{name}(ref_model=None) on a parallel module of a peft model: TRL does not see a "
                         "PeftModel, so it would load the base model from config._name_or_path as the reference "
                         "instead of the frozen copy of the adapter it uses for the unsharded peft model. "
                         f"{_EXACT[0].upper()}{_EXACT[1:]}")
