"""Per-stage sizes of a hierarchical model's tiny config (Swin's ``depths`` and ``num_heads``, a ResNet's
``hidden_sizes``): which lists are per-stage, and their small values.

A hierarchical model counts its layers by stage, so ``tiny.shrink`` keeps every stage and shrinks each: a few
blocks deep, narrower, with head counts tp can split.
"""

from __future__ import annotations


def is_stage_list(name: str, value) -> bool:
    """Per-stage sizes of a hierarchical model (Swin's ``depths`` and ``num_heads``, a ResNet's
    ``hidden_sizes``): a short list of positive ints."""
    return isinstance(value, list) and 1 < len(value) <= 8 and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value) and stage_kind(name) is not None


def stage_kind(name: str) -> str | None:
    """What a per-stage list named ``name`` counts: ``"depth"`` (blocks), ``"heads"`` or ``"width"``; None if its
    name says none of them."""
    if "depth" in name or name in ("num_layers", "layers"):
        return "depth"
    if "heads" in name:
        return "heads"
    if name.endswith(("hidden_sizes", "embed_dims", "embed_dim", "dims", "channels", "widths", "hidden_size")):
        return "width"
    return None


def small_stages(name: str, values: list) -> list:
    """Stages kept, each small: at most two blocks deep, widths a quarter (at least 16), heads rounded up to a
    power of two, at least four as ``SMALL_HF``'s (so that tp in {1, 2, 4} divides them, an early stage's one or
    two heads included, and the widths, multiples of 16 times the stage's scale, split into heads of equal
    size)."""
    kind = stage_kind(name)
    if kind == "depth":
        return [min(v, 2) for v in values]
    if kind == "heads":
        return [max(4, 1 << (v - 1).bit_length()) for v in values]
    return [v if v <= 64 else max(16, v // 4) for v in values]


def spelled_out_blocks(fields: dict) -> bool:
    """Whether the config lists its blocks one by one with their channel counts (PP-LCNet's ``block_configs``: per
    stage, per block, kernel, input and output widths...) repeating the widths of its per-stage lists: shrinking
    the per-stage lists alone would break the tie."""
    widths = {v for k, value in fields.items() if is_stage_list(k, value) and stage_kind(k) == "width"
              for v in value if v > 64}
    nested = [value for value in fields.values()
              if isinstance(value, list) and value and all(isinstance(v, list) for v in value)]
    return bool(widths & set(_ints_within(nested)))


def _ints_within(value) -> list:
    """Every int in ``value``, a list nested to any depth."""
    if isinstance(value, list):
        return [i for v in value for i in _ints_within(v)]
    return [value] if isinstance(value, int) and not isinstance(value, bool) else []
