"""diffusers' transformer models for the zoo, when diffusers is installed: each at a tiny size, fed a latent,
a timestep and (where it takes them) text embeddings, as its pipeline feeds it."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from devtools.zoo_entries import Entry

B = 2


def _seeded(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _timestep() -> torch.Tensor:
    return torch.tensor([10.0, 500.0])


def _dit() -> nn.Module:
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
                                 num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)


def _dit_inputs(_model) -> dict:
    return {"hidden_states": _seeded(B, 4, 8, 8), "timestep": torch.tensor([1, 5]),
            "class_labels": torch.tensor([0, 3])}


def _sd3(qk_norm: str | None) -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                 num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
                                 pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16, qk_norm=qk_norm)


def _sd3_inputs(_model) -> dict:
    return {"hidden_states": _seeded(B, 4, 8, 8), "encoder_hidden_states": _seeded(B, 6, 32),
            "pooled_projections": _seeded(B, 32), "timestep": _timestep()}


def _flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


def _flux_inputs(_model) -> dict:
    image, text = 16, 6
    return {"hidden_states": _seeded(B, image, 16), "encoder_hidden_states": _seeded(B, text, 32),
            "pooled_projections": _seeded(B, 32), "timestep": torch.tensor([0.1, 0.5]),
            "img_ids": torch.zeros(image, 3), "txt_ids": torch.zeros(text, 3)}


def _pixart() -> nn.Module:
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
                                    num_layers=2, cross_attention_dim=64, sample_size=8, patch_size=2,
                                    caption_channels=32, use_additional_conditions=False)


def _pixart_inputs(_model) -> dict:
    return {"hidden_states": _seeded(B, 4, 8, 8), "encoder_hidden_states": _seeded(B, 6, 32),
            "timestep": _timestep()}


MODELS = {
    "DiTTransformer2DModel": (_dit, _dit_inputs),
    "SD3Transformer2DModel": (lambda: _sd3(None), _sd3_inputs),
    "SD3Transformer2DModel:qk_norm": (lambda: _sd3("rms_norm"), _sd3_inputs),
    "FluxTransformer2DModel": (_flux, _flux_inputs),
    "PixArtTransformer2DModel": (_pixart, _pixart_inputs),
}
"""Each model: its tiny constructor and its inputs."""


def diffusers_entries() -> list[Entry]:
    """The diffusers transformers above, when diffusers is installed."""
    if importlib.util.find_spec("diffusers") is None:
        return []
    return [Entry(f"diffusers:{name}", "diffusers", build, inputs) for name, (build, inputs) in MODELS.items()]
