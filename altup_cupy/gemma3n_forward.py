"""Gemma3nTextModel.forward and Gemma3nTextDecoderLayer.forward written out by hand, with AltUp on
altup_cupy.

transformers writes the expansion (the token embeddings -> N streams) and the collapse (N streams
-> one hidden state) inline in `Gemma3nTextModel.forward`, so the only way to run them on our
operators is to replace that forward. As Liger-Kernel does for the models it patches, the package
keeps its own copy of the forward: the installed forward's steps in the installed order, with the
two inline blocks replaced by `expand(self, embeddings)` and `collapse(self, streams)`.

The decoder layer reads two rows of AltUp's [N, B, S, H] outputs on their own: the active
prediction (the input of attention and of the residual) and the corrected active row (the input
of the per-layer-input branch, whose result is added back to streams 1..N-1). As views of the
streams, each costs the backward a pass over all N rows: autograd adds the row's gradient into a
zero-filled [N, B, S, H] tensor, then that to the streams' gradient. The layer's own copy calls
`predict(altup, streams)` and `correct(altup, predictions, activated)`, which return the active row
as a tensor of its own next to the streams (the kernels write it as they write the streams); its
gradient then reaches the backward kernel apart and is added there as the rows are read.

A hand-written forward is right only for the transformers releases it was written against.
`KNOWN_FORWARDS` and `KNOWN_LAYER_FORWARDS` map the fingerprint of each such release's forward (its
syntax tree, without docstring or comments) to the two names that differ between them: the keyword
that carries the KV cache and the class that holds the KV states shared between layers.
`text_model_forward` and `decoder_layer_forward` return None for any other forward, and the patch
then keeps transformers' forward (with a warning).
"""

from __future__ import annotations

import ast
import collections
import hashlib
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Dialect:
    """What differs between the forwards this module reproduces."""

    releases: str  # the transformers releases checked to have this forward (documentation)
    cache_keyword: str  # the KV cache's keyword in the forward, the mask builders, the layers and the output
    kv_storage: str  # the class of the per-call store of shared KV states: "UserDict" or a modeling name


UNTIL_5_22 = Dialect("5.17 - 5.22", "past_key_values", "UserDict")
RELEASE_5_23 = Dialect("5.23", "past_key_values", "KVSharingDict")
FROM_5_24 = Dialect("5.24 - 5.25", "cache", "KVSharingDict")
# Gemma3nTextModel.forward
KNOWN_FORWARDS = {"ba4e9bd9da9c5bb1": UNTIL_5_22, "dbf400850f7e5ec5": RELEASE_5_23, "1a5fb3d2afc2ef61": FROM_5_24}
# Gemma3nTextDecoderLayer.forward
KNOWN_LAYER_FORWARDS = {"fdd53bf153a6da55": UNTIL_5_22, "ba4362c6b40e9399": RELEASE_5_23,
                        "c0d1f2f535efc4bb": FROM_5_24}


def fingerprint(function: Callable) -> str:
    """A hash of `function`'s source as a syntax tree: decorators and code, not its docstring,
    comments or layout. Hashed as the tree written back to source (`ast.unparse`), which is the
    same on every Python release the package supports (`ast.dump` is not: 3.12 added fields)."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    definition = ast.parse(source).body[0]
    if ast.get_docstring(definition) is not None:
        definition.body = definition.body[1:]
    return hashlib.sha256(ast.unparse(definition).encode()).hexdigest()[:16]


def _kv_storage(modeling, dialect: Dialect) -> type:
    return collections.UserDict if dialect.kv_storage == "UserDict" else getattr(modeling, dialect.kv_storage)


def text_model_forward(modeling, installed: Callable, expand: Callable, collapse: Callable) -> Callable | None:
    """The forward for the installed `modeling_gemma3n` module, or None if `installed` (its
    Gemma3nTextModel.forward) is not one of KNOWN_FORWARDS. expand(model, embeddings) -> streams
    [N, B, S, H]; collapse(model, streams) -> [B, S, H], before the final norm."""
    dialect = KNOWN_FORWARDS.get(fingerprint(installed))
    if dialect is None:
        return None
    cache_keyword = dialect.cache_keyword
    kv_storage = _kv_storage(modeling, dialect)

    def forward(self, input_ids: torch.LongTensor | None = None, per_layer_inputs: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None,
                cache=None, inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None, **kwargs):
        # The KV cache arrives under either name: `cache` (transformers >= 5.24) or `past_key_values`.
        cache = kwargs.pop("past_key_values", cache)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            inputs_embeds = self.embed_tokens(input_ids)
            per_layer_inputs = self.get_per_layer_inputs(input_ids)
        per_layer_inputs = self.project_per_layer_inputs(inputs_embeds, per_layer_inputs)

        if use_cache and cache is None:
            cache = modeling.DynamicCache(config=self.config)
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen).unsqueeze(0)

        masks = attention_mask  # already one mask per attention type when `generate` prepared them
        if not isinstance(masks, dict):
            mask_arguments = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                              cache_keyword: cache, "position_ids": position_ids}
            masks = {"full_attention": modeling.create_causal_mask(**mask_arguments),
                     "sliding_attention": modeling.create_sliding_window_causal_mask(**mask_arguments)}

        hidden_states = expand(self, inputs_embeds)  # [N, B, S, H]
        layer_types = self.config.layer_types
        position_embeddings = {kind: self.rotary_emb(hidden_states, position_ids, kind) for kind in set(layer_types)}
        shared_kv_states = kv_storage()  # filled by the layers that store KV states for later ones
        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states = decoder_layer(hidden_states, position_embeddings[layer_types[i]], per_layer_inputs[:, :, i, :],
                                          shared_kv_states=shared_kv_states, attention_mask=masks[layer_types[i]],
                                          position_ids=position_ids, **{cache_keyword: cache}, **kwargs)
        hidden_states = self.norm(collapse(self, hidden_states))
        return modeling.BaseModelOutputWithPast(last_hidden_state=hidden_states, **{cache_keyword: cache})

    # The installed forward's own decorators, outermost last (KNOWN_FORWARDS pins them): defaults
    # from the config (use_cache), and the hooks that collect hidden states and attentions.
    return modeling.merge_with_config_defaults(modeling.capture_outputs(tie_last_hidden_states=False)(forward))


def decoder_layer_forward(installed: Callable, predict: Callable, correct: Callable) -> Callable | None:
    """The forward for the installed Gemma3nTextDecoderLayer, or None if `installed` (its forward)
    is not one of KNOWN_LAYER_FORWARDS. predict(altup, streams) -> (predictions, a copy of the
    active prediction); correct(altup, predictions, activated) -> (corrected, a copy of the corrected
    active row)."""
    dialect = KNOWN_LAYER_FORWARDS.get(fingerprint(installed))
    if dialect is None:
        return None
    cache_keyword = dialect.cache_keyword

    def forward(self, hidden_states: torch.Tensor, position_embeddings: torch.Tensor | None = None,
                per_layer_input: torch.Tensor | None = None, shared_kv_states=None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None,
                cache=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)  # either name, as in `text_model_forward`
        predictions, active_prediction = predict(self.altup, hidden_states)

        active_prediction_normed = self.input_layernorm(active_prediction)
        laurel_output = self.laurel(active_prediction_normed)
        attn, _ = self.self_attn(hidden_states=active_prediction_normed, attention_mask=attention_mask,
                                 shared_kv_states=shared_kv_states, position_ids=position_ids,
                                 position_embeddings=position_embeddings, **{cache_keyword: cache}, **kwargs)
        attn = self.post_attention_layernorm(attn)

        attn_gated = active_prediction + attn
        attn_laurel = (attn_gated + laurel_output) / math.sqrt(2)
        attn_norm = self.pre_feedforward_layernorm(attn_laurel)
        attn_ffw = self.mlp(attn_norm)
        attn_ffw_norm = self.post_feedforward_layernorm(attn_ffw)
        attn_ffw_laurel_gated = attn_laurel + attn_ffw_norm
        corrected_predictions, first_prediction = correct(self.altup, predictions, attn_ffw_laurel_gated)

        if self.config.altup_correct_scale:
            first_prediction = self.altup.scale_corrected_output(first_prediction)
        first_prediction = self.per_layer_input_gate(first_prediction)
        first_prediction = self.act_fn(first_prediction)
        first_prediction = torch.multiply(first_prediction, per_layer_input)
        first_prediction = self.per_layer_projection(first_prediction)
        first_prediction = self.post_per_layer_input_norm(first_prediction)
        return add_to_later_streams(corrected_predictions, first_prediction)

    return forward


def add_to_later_streams(streams: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """`streams[1:] += update`, returning `streams`: through `AddToLaterStreams` where autograd
    records the step, as a plain in-place add where it does not (inference, no_grad), which
    torch.compile traces without a graph break (it cannot trace an autograd.Function that marks its
    input dirty when no gradient is recorded)."""
    if torch.is_grad_enabled() and (streams.requires_grad or update.requires_grad):
        return AddToLaterStreams.apply(streams, update)
    streams[1:] += update
    return streams


class AddToLaterStreams(torch.autograd.Function):
    """`streams[1:] += update` (the decoder layer's last step), in place, with its backward written
    out: the streams' gradient passes on as it is and the update's is its sum over streams 1..N-1.
    Autograd's own backward of an in-place add into a slice (CopySlices in eager, a chain of
    slice_scatter under torch.compile) writes the whole [N, B, S, H] gradient once more per layer
    before the correct backward reads it."""

    @staticmethod
    def forward(ctx, streams: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        streams[1:] += update
        ctx.mark_dirty(streams)
        ctx.update_shape = update.shape
        return streams

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_update = grad[1:].sum_to_size(ctx.update_shape) if ctx.needs_input_grad[1] else None
        return grad, grad_update
