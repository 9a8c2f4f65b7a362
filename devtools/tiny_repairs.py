"""Repairs of a tiny config from the errors it raises. The zoo's tiny configs (``devtools.tiny``) shrink every
size field by rule, and some architectures tie sizes together in their own validation: where that validation (or
the model built from the config) states in its message the value a field must take (``X must be 0``, ``X (2) must
equal Y (4)``, ``X (16) must be divisible by Y (32)``, ``X must equal A + B``, a size the config reads but does not
declare), the rules here read the message and set that field where it lives, and the build is tried again.
"""

from __future__ import annotations

import math
import re

_REQUIREMENTS = (
    # hidden_size_per_layer_input must be 0, got 256
    re.compile(r"`?(?:config\.)?(?P<field>[\w.]+)`? must (?:be|equal) (?P<value>-?\d+|True|False|None)\b"),
    # `num_key_value_heads` (2) must equal `num_attention_heads` (4)
    # `adaptor_config.intermediate_size` (128) must equal `text_config.hidden_size // 4` (16)
    re.compile(r"`?(?:config\.)?(?P<field>[\w.]+)`? \(-?\d+\) must (?:equal|match) (?:`[^`]+`|[\w.]+) "
               r"\((?P<value>-?\d+)\)"),
    # make sure that `is_decoder=True`
    re.compile(r"`(?:config\.)?(?P<field>\w+)=(?P<value>True|False|-?\d+)`"),
)
"""Messages (of a config's validation, or of a model refusing its config) that state the one value a field
may take."""

_DIVISOR = re.compile(r"`?[\w.]+`? \((?P<size>\d+)\) (?:must|should) be divisible by `?(?:config\.)?(?P<field>[\w.]+)`? "
                      r"\((?P<value>\d+)\)")
"""A size that a field must divide (``num_channels (16) must be divisible by num_groups (32)``: group norms over
channels shrunk more than their group count): the field takes the largest value dividing both."""


_INDICES = re.compile(r"`?(?:config\.)?(?P<field>[\w.]+)`? \[(?P<values>-?\d+(?:, -?\d+)*)\] must index the "
                      r"(?P<count>\d+) layers")
"""Layer indices (Molmo2's ``vision_feature_layer``, ``[24, 18]``) past the layers a tiny tower has: each takes the
layer of its rank among them counted from the last, so the deepest stays the last layer."""


def _within(values: list[int], count: int) -> list[int]:
    """``values`` (layer indices) moved into ``count`` layers, their order kept: the largest the last layer, the next
    below it, and so on (never below the first)."""
    ranked = sorted(set(values), reverse=True)
    return [max(0, count - 1 - ranked.index(v)) for v in values]


_PER_STAGE = re.compile(r"(?P<lists>`\w+`(?:, `\w+`)* and `\w+`) must have one entry per layer, got (?P<value>\d+)"
                        r"(?:, \d+)* and (?P=value) for `(?P<field>\w+)`=\d+")
"""A layer count that counts the stages of per-stage lists (``patch_sizes``, ``hidden_sizes`` and ``depths``, kept
at their stage count): it takes the lists' length, in the (sub-)config that holds them."""

_TIED = re.compile(r"`?(?P<field>\w+)`? must (?:equal|match) `?(?P<a>[a-z_]\w*)`?(?: \+ `?(?P<b>[a-z_]\w*)`?)?(?! \()")
"""A size that must equal another field, or the sum of two (a head of a non-rotary and a rotary part), named
without values."""

_UNDECLARED = re.compile(r"'\w+Config' object has no attribute '(?P<field>\w+)'")
"""A model reading a field its config does not declare: a size (``num_key_value_heads`` of a config without one)
takes its small value; another field the value another part of the config holds under that name."""


def repaired(make, small: dict, sizes: dict, defaults: dict | None = None):
    """``make()``, with the fields its errors require set in ``small`` and tried again (a few times). ``sizes``:
    the small value of each size field by name, for a field the config reads but does not declare; ``defaults``:
    the default config's fields (where another part may hold such a field)."""
    for _ in range(8):
        try:
            return make()
        except Exception as e:  # any type: the message is what is read
            if not apply_required(small, _messages(e), sizes, defaults):
                raise
    return make()


def _held_elsewhere(fields: dict, name: str):
    """The value a config's ``fields`` hold under ``name`` one level down (DBRX's attention sub-config read for a
    ``rope_theta`` the config keeps in its ``rope_parameters``); None if no part holds it."""
    return next((v[name] for v in fields.values() if isinstance(v, dict) and v.get(name) is not None), None)


def _messages(e: BaseException) -> str:
    out = []
    while e is not None:
        out.append(str(e))
        e = e.__cause__
    return " ".join(out)


_LITERALS = {"True": True, "False": False, "None": None}


def _requirement(message: str) -> tuple[str, object] | None:
    """The (dotted) field a message requires a value of, and that value; None if it states none."""
    for pattern in _REQUIREMENTS:
        match = pattern.search(message)
        if match:
            text = match["value"]
            return match["field"], _LITERALS[text] if text in _LITERALS else int(text)
    match = _INDICES.search(message)
    if match:
        return match["field"], _within([int(v) for v in match["values"].split(", ")], int(match["count"]))
    match = _DIVISOR.search(message)
    if match:
        return match["field"], math.gcd(int(match["size"]), int(match["value"]))
    return None


def apply_required(small: dict, message: str, sizes: dict, defaults: dict | None = None) -> bool:
    """Set the field a message requires, in the sub-config its dotted name or its presence points to (else the
    config itself); False if no message states one, or the field already has that value. ``sizes``: the small
    value of each size field by name (a field the config does not declare takes it); ``defaults``: the default
    config's fields, where another part may hold a field the config does not declare."""
    undeclared = _UNDECLARED.search(message)
    held = _held_elsewhere((defaults or {}) | small, undeclared["field"]) if undeclared else None
    if undeclared and (undeclared["field"] in sizes or held is not None):
        # set where it is missing: the config itself, else the first sub-config without it (a retry that still
        # misses it moves on to the next)
        holders = [small] + [v for v in small.values() if isinstance(v, dict) and "model_type" in v]
        target = next((h for h in holders if undeclared["field"] not in h), None)
        if target is not None:
            name = undeclared["field"]
            # a config without key-value heads has one per attention head
            same = target.get("num_attention_heads") if name == "num_key_value_heads" else None
            target[name] = same if isinstance(same, int) else sizes[name] if name in sizes else held
            return True
    staged = _PER_STAGE.search(message)
    if staged:
        holder = next((h for name in re.findall(r"`(\w+)`", staged["lists"])
                       if (h := _holding(small, name)) is not None), None)
        if holder is not None and holder.get(staged["field"]) != int(staged["value"]):
            holder[staged["field"]] = int(staged["value"])
            return True
    tied = _TIED.search(message)
    if tied:  # head_dim must equal qk_nope_head_dim + qk_rope_head_dim: the parts' sum as they now are
        parts = [p for p in (tied["a"], tied["b"]) if p]
        holders = [small] + [v for v in small.values() if isinstance(v, dict)]
        holder = next((h for h in sorted(holders, key=lambda h: tied["field"] not in h)  # the field's own first
                       if all(isinstance(h.get(p), int) and not isinstance(h.get(p), bool) for p in parts)), None)
        if holder is not None and holder.get(tied["field"]) != sum(holder[p] for p in parts):
            holder[tied["field"]] = sum(holder[p] for p in parts)
            return True
    required = _requirement(message)
    if required is None:
        return False
    field, value = required
    *path, name = field.split(".")
    target = _holder(small, path[0]) if path else small
    for part in path:
        target = target.setdefault(part, {}) if isinstance(target.get(part, {}), dict) else {}
    if not path:
        target = next((v for v in small.values() if isinstance(v, dict) and name in v), small)
    if name in target and target[name] == value:
        return False
    target[name] = value
    return True


def _holder(small: dict, part: str) -> dict:
    """The (sub-)config dict in ``small`` that has a sub-config named ``part``, the top one first (a message may
    name a sub-config of a sub-config, ``head_config`` within ``word_timestamp_config``); ``small`` if none."""
    if isinstance(small.get(part), dict):
        return small
    for value in small.values():
        if isinstance(value, dict) and value is not small:
            found = _holder(value, part)
            if isinstance(found.get(part), dict):
                return found
    return small


def _holding(small: dict, name: str) -> dict | None:
    """The (sub-)config dict in ``small`` that sets ``name``, the top one first; None if none does."""
    if name in small:
        return small
    return next((found for v in small.values() if isinstance(v, dict) and (found := _holding(v, name)) is not None),
                None)
