"""Small Gemma 3n pieces for the tests: random AltUp inputs and tiny transformers modules (no downloads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch


@dataclass
class AltUpInputs:
    hidden_states: torch.Tensor  # [N, B, S, H]
    activated: torch.Tensor  # [B, S, H]
    prediction_coefs: torch.Tensor  # [N*N, N]
    correction_coefs: torch.Tensor  # [N, N]
    router_weight: torch.Tensor  # [N, H]
    norm_weight: torch.Tensor  # [H]
    projections: torch.Tensor  # [N-1, H, H]
    grad_streams: torch.Tensor  # [N, B, S, H]
    grad_row: torch.Tensor  # [B, S, H]


def random_altup_inputs(seed: int, streams: int, batch: int = 2, seq: int = 3, hidden: int = 16,
                        dtype=torch.float64, coef_scale: float = 0.5) -> AltUpInputs:
    """Fresh random inputs on the scales of a trained model (router weights large enough that
    tanh is not saturated nor linear)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    return AltUpInputs(
        hidden_states=randn(streams, batch, seq, hidden),
        activated=randn(batch, seq, hidden),
        prediction_coefs=randn(streams * streams, streams, scale=coef_scale),
        correction_coefs=randn(streams, streams, scale=coef_scale),
        router_weight=randn(streams, hidden, scale=float(hidden)),
        norm_weight=1.0 + randn(hidden, scale=0.3),
        projections=randn(streams - 1, hidden, hidden, scale=hidden ** -0.5),
        grad_streams=randn(streams, batch, seq, hidden),
        grad_row=randn(batch, seq, hidden),
    )


def transformers_gemma3n():
    """transformers' modeling_gemma3n, or a skip naming what is missing."""
    return pytest.importorskip("transformers.models.gemma3n.modeling_gemma3n",
                               reason="transformers with Gemma 3n is not installed")


def tiny_text_config(streams: int = 4, hidden: int = 16, active_idx: int = 0, layers: int = 2,
                     coef_clip: float = 120.0, **sizes):
    """A real Gemma3nTextConfig with small sizes (random init, nothing downloaded); `sizes`
    overrides any other constructor argument (vocab_size, intermediate_size, ...)."""
    from transformers import Gemma3nTextConfig

    arguments = dict(
        vocab_size=64, vocab_size_per_layer_input=64, hidden_size=hidden, intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        hidden_size_per_layer_input=4, laurel_rank=4, num_kv_shared_layers=0,
        altup_num_inputs=streams, altup_active_idx=active_idx, altup_coef_clip=coef_clip,
        sliding_window=8, layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
        activation_sparsity_pattern=[0.0] * layers, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=2, eos_token_id=1, attn_implementation="eager",
    )
    return Gemma3nTextConfig(**{**arguments, **sizes})


def count_altup_calls(set_attribute: Callable = setattr) -> dict[str, int]:
    """How often each altup_cupy.torch operator (the patched model's route) is called from now on:
    a dict that counts up, `predict_with_active` and `correct_with_active` (the patched decoder
    layer's forms) under "predict" and "correct". With pytest's `monkeypatch.setattr` the counting
    ends with the test; with the default it lasts for the rest of the process."""
    from altup_cupy import torch as altup

    calls = dict.fromkeys(("predict", "correct", "expand", "collapse"), 0)
    counted_as = {"predict": "predict", "predict_with_active": "predict", "correct": "correct",
                  "correct_with_active": "correct", "expand": "expand", "collapse": "collapse"}
    for name, key in counted_as.items():
        function = getattr(altup, name)

        def counted(*args, _key=key, _function=function, **kwargs):
            calls[_key] += 1
            return _function(*args, **kwargs)

        set_attribute(altup, name, counted)
    return calls
