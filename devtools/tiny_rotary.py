"""Multimodal rotary sections of a tiny config (``rope_parameters.mrope_section``): the rotary half of a head split
among time, height and width, which must add up to the shrunk head's half.
"""

from __future__ import annotations


def rotary_sections(fields: dict, small: dict, takes_sections: bool = False) -> dict:
    """Multimodal rotary sections (``rope_parameters.mrope_section``: the rotary half of a head split among time,
    height and width) scaled to the shrunk head, in the same proportions; {} if there are none or they fit. A
    config that ``takes_sections`` but leaves them to the model's code (sized for the full head) gets three equal
    ones. Rotary settings per kind of layer (``{"full_attention": {...}}``) are scaled kind by kind; where the
    default config leaves them empty for the model to read by kind, each kind of layer gets the default rotary
    embedding."""
    rope = fields.get("rope_parameters")
    kinds = fields.get("layer_types")
    if rope == {} and takes_sections and isinstance(kinds, list) and kinds:
        rope = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in dict.fromkeys(kinds)}
    if not isinstance(rope, dict) or not rope:
        return {}
    merged = fields | small
    if all(isinstance(v, dict) for v in rope.values()):
        out = {kind: _scaled_sections(v, merged, takes_sections) or v for kind, v in rope.items()}
        return {"rope_parameters": out} if out != fields.get("rope_parameters") else {}
    scaled = _scaled_sections(rope, merged, takes_sections)
    return {"rope_parameters": scaled} if scaled else {}


def _scaled_sections(rope: dict, merged: dict, takes_sections: bool) -> dict | None:
    """One rotary setting with its sections scaled to the head of ``merged`` (a config's fields); None if it has
    none to scale or they fit."""
    sections = rope.get("mrope_section")
    if sections is None and takes_sections:
        sections = [1, 1, 1]
    if not isinstance(sections, list) or not all(isinstance(v, int) for v in sections):
        return None  # before the head's width, which a model with heads per stage (a list) does not have
    head = merged.get("head_dim") or (merged.get("hidden_size") or 0) // (merged.get("num_attention_heads") or 1)
    # a partial rotary embedding turns only this share of each head
    share = rope.get("partial_rotary_factor") or merged.get("partial_rotary_factor") or 1
    half = int(head * share) // 2
    if not half or sum(sections) == half:
        return None
    shares = [v * half / sum(sections) for v in sections]
    scaled = [int(v) for v in shares]
    for i in sorted(range(len(shares)), key=lambda i: scaled[i] - shares[i])[: half - sum(scaled)]:
        scaled[i] += 1  # the largest remainders take what rounding down left
    return rope | {"mrope_section": scaled}
