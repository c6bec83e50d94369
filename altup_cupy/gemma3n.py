"""A drop-in for transformers' Gemma 3n: AltUp predict/correct, expansion and collapse on altup_cupy.

    import altup_cupy.gemma3n
    altup_cupy.gemma3n.patch()          # every Gemma 3n text model, present and future
    altup_cupy.gemma3n.patch(model)     # or only this instance
    altup_cupy.gemma3n.unpatch()        # (or unpatch(model)) restores transformers' own code

As Liger-Kernel does, `patch()` replaces methods on transformers' classes and `patch(model)` binds
replacements on the modules of one instance:
- `Gemma3nTextAltUp.predict` / `.correct` of every decoder layer -> `altup_cupy.torch.predict` /
  `.correct`, with transformers' semantics: N = config.altup_num_inputs, a = config.altup_active_idx,
  eps = the router norm's epsilon, the router scale of the `router_input_scale` buffer, and in training
  mode the coefficient clipping of `config.altup_coef_clip` (the prediction weights clamped in
  place, the correction weights clamped out of place, so their gradient is masked where the clamp
  is active).
- `Gemma3nTextModel.forward`, which writes the expansion and collapse inline -> the package's own
  copy of that forward with those two blocks on `altup_cupy.torch.expand` / `.collapse`
  (`altup_cupy.gemma3n_forward`), used only where the installed forward is one it reproduces; on
  any other transformers release they stay transformers' own and a warning says so.
- `Gemma3nTextDecoderLayer.forward` -> the package's own copy (`altup_cupy.gemma3n_forward`, on the
  same terms), which takes the active prediction and the corrected active row as tensors of their
  own (`altup_cupy.torch.predict_with_active` / `correct_with_active`), so their gradients join
  the streams' inside the backward kernels.

Where the kernels do not serve a call (not CUDA, not bfloat16, N outside 2..4, H % 8 != 0 or
H > 3072), the call warns once and runs transformers' own code: never a wrong answer.
Under torch.compile, a call of fewer than `compiled_min_tokens` tokens (default
COMPILED_MIN_TOKENS) also runs transformers' code, without a warning: there a compiled step waits on
the host, not the GPU, and Inductor's fused kernels cost the host less per step than the package's
operator calls (their kernels are faster; results/nvidia-h200/NOTES.md has the measurements).
`patch(compiled_min_tokens=0)` serves every compiled call. Eager calls are always served.
`patch(serve_cpu=True)` sends CPU tensors through the operators' CPU reference instead (for testing
the integration without a GPU) where they share one dtype it takes (bfloat16, float32 or float64)
and have a shape the kernels serve; `patch(model, serve_cpu=...)` sets it for that model alone.
"""

from __future__ import annotations

import copyreg
import functools
import importlib
import warnings
from types import MethodType

import torch

from . import gemma3n_forward
from .ops import gemma3n_altup
from . import torch as altup
from ._extras import missing
from ._arrays import CPU_DTYPES

_MODELING = "transformers.models.gemma3n.modeling_gemma3n"
_PATCHED_ATTRIBUTES = {"Gemma3nTextAltUp": ("predict", "correct"), "Gemma3nTextModel": ("forward",),
                       "Gemma3nTextDecoderLayer": ("forward",)}
_originals: dict[tuple[type, str], object] = {}  # (class, attribute) -> transformers' function
# Below this many tokens a compiled call is host-bound and transformers' code, fused by Inductor, is faster
# in wall time. The whole-model runs (NOTES.md) put the crossover between 1 x 256, where the operators lost
# under torch.compile, and 1 x 4096, where they won; 2048 lies between, it is not a measured crossover.
COMPILED_MIN_TOKENS = 2048
_settings = {"serve_cpu": False, "compiled_min_tokens": COMPILED_MIN_TOKENS}  # of the class patch
# The attributes an instance patch sets on each module it patches (its own settings)
_SERVE_CPU = "_altup_cupy_serve_cpu"
_COMPILED_MIN_TOKENS = "_altup_cupy_compiled_min_tokens"


def _modeling():
    try:
        return importlib.import_module(_MODELING)
    except ImportError as error:
        raise missing("transformers with Gemma 3n (>= 5.17)", "gemma3n", error.name) from error


def _modeling_layers():
    return importlib.import_module("transformers.modeling_layers")


def _original(cls: type, name: str):
    """transformers' own function, whether or not the class is patched now."""
    return _originals.get((cls, name), cls.__dict__[name])


def _dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype) for t in tensors})


def _serves_cpu(module) -> bool:
    return module.__dict__.get(_SERVE_CPU, _settings["serve_cpu"])


def _left_to_inductor(module, tokens) -> bool:
    """Whether this call, of `tokens` tokens, runs transformers' code because it is being compiled
    and is too small for the operators to pay for their host cost (COMPILED_MIN_TOKENS). A symbolic
    token count adds a guard: a compiled graph serves one side of the threshold."""
    if not torch.compiler.is_compiling():
        return False
    return tokens < module.__dict__.get(_COMPILED_MIN_TOKENS, _settings["compiled_min_tokens"])


def _rows(streams: torch.Tensor) -> int:
    """Tokens of AltUp's streams [N, B, S, H]: B x S (from sizes alone: no view made on the eager path)."""
    return streams.numel() // (streams.shape[0] * streams.shape[-1])


def _unserved(module, what: str, tensors, streams: int, hidden: int) -> str | None:
    """Why the kernels cannot take this call of `module` (warned once per reason), or None. The CPU
    reference (serve_cpu) is held to the kernels' shapes, so that a model served on the CPU is served
    on CUDA."""
    reason = gemma3n_altup.cuda_serves(streams, hidden)
    if reason is None:
        first = tensors[0]
        if first.device.type == "cpu" and _serves_cpu(module):
            if first.dtype not in CPU_DTYPES or any(t.dtype != first.dtype for t in tensors):
                reason = f"dtype {_dtypes(tensors)} (the CPU reference takes one of bfloat16, float32 and float64)"
        elif first.device.type != "cuda":
            reason = f"tensors on {first.device.type} (the kernels run on CUDA)"
        elif any(t.dtype != torch.bfloat16 for t in tensors):
            reason = f"dtype {_dtypes(tensors)} (the kernels take bfloat16)"
    if reason is not None:
        warnings.warn(f"altup_cupy.gemma3n: {what} runs transformers' own code for {reason}", stacklevel=3)
    return reason


def _coefficients(module, weight: torch.Tensor) -> torch.Tensor:
    clip = module.config.altup_coef_clip
    return weight.clamp(-clip, clip) if module.training and clip is not None else weight


_ROUNDED_INVERSES: dict[tuple[int, torch.dtype], float] = {}


@torch.compiler.assume_constant_result
def _rounded_inverse(hidden: int, dtype: torch.dtype) -> float:
    """1 / hidden made in fp32 and converted to `dtype`, as a Python float, computed once per
    (hidden, dtype). torch.compile calls it while tracing and keeps the result as a constant of
    the graph: no `.item()` in the trace, so no graph break."""
    key = (hidden, dtype)
    if key not in _ROUNDED_INVERSES:
        _ROUNDED_INVERSES[key] = torch.tensor(hidden ** -1.0, dtype=torch.float32).to(dtype).item()
    return _ROUNDED_INVERSES[key]


def _router_scale(module) -> float:
    """The value of the module's `router_input_scale` buffer (1 / H made in fp32, then converted to
    the buffer's dtype), computed on the host from H and the dtype: reading the buffer would
    synchronise with the GPU on every call."""
    return _rounded_inverse(module.config.hidden_size, module.router_input_scale.dtype)


def _router_eps(module) -> float:
    """The router norm's epsilon: transformers >= 5.25 keeps it in `variance_epsilon`, earlier
    releases in `eps`."""
    norm = module.router_norm
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _predict_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return self.prediction_coefs.weight, self.modality_router.weight, self.router_norm.weight


def _predict_arguments(self, hidden_states: torch.Tensor) -> tuple:
    """The arguments of altup_cupy.torch.predict for this Gemma3nTextAltUp's predict step (served)."""
    if self.training and self.config.altup_coef_clip is not None:  # in place, as transformers does
        clip = self.config.altup_coef_clip
        self.prediction_coefs.weight.data.clamp_(-clip, clip)
    return (hidden_states.contiguous(), *_predict_weights(self), self.config.altup_active_idx, _router_eps(self),
            _router_scale(self))


def _correct_arguments(self, predictions: torch.Tensor, activated: torch.Tensor) -> tuple:
    """The arguments of altup_cupy.torch.correct for this Gemma3nTextAltUp's correct step (served)."""
    return (predictions.contiguous(), activated.contiguous(), _coefficients(self, self.correction_coefs.weight),
            self.modality_router.weight, self.router_norm.weight, self.config.altup_active_idx, _router_eps(self),
            _router_scale(self))


def _replacing(name: str):
    """Marks a function as the patch's replacement of the method `name`: pickling a patched module
    (`_PatchedState`) binds such a method again on loading."""
    def mark(function):
        function.altup_cupy_replaces = name
        return function
    return mark


@_replacing("predict")
def _predict(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if _left_to_inductor(self, _rows(hidden_states)) or _unserved(
            self, "AltUp predict", (hidden_states, *_predict_weights(self)), self.config.altup_num_inputs,
            hidden_states.shape[-1]):
        return _original(type(self), "predict")(self, hidden_states)
    return altup.predict(*_predict_arguments(self, hidden_states))


@_replacing("correct")
def _correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
    weights = (self.correction_coefs.weight, self.modality_router.weight, self.router_norm.weight)
    if _left_to_inductor(self, _rows(predictions)) or _unserved(
            self, "AltUp correct", (predictions, activated, *weights), self.config.altup_num_inputs,
            activated.shape[-1]):
        return _original(type(self), "correct")(self, predictions, activated)
    return altup.correct(*_correct_arguments(self, predictions, activated))


# ---- the decoder layer's forward, with the active rows as tensors of their own ------------------

def _predict_with_active(altup_module, hidden_states: torch.Tensor):
    return altup.predict_with_active(*_predict_arguments(altup_module, hidden_states))


def _correct_with_active(altup_module, predictions: torch.Tensor, activated: torch.Tensor):
    return altup.correct_with_active(*_correct_arguments(altup_module, predictions, activated))


def _layer_forward(modeling):
    """Gemma3nTextDecoderLayer.forward with AltUp's active rows as tensors of their own
    (`gemma3n_forward.decoder_layer_forward`), or None (with a warning) where the installed forward
    is not one that module reproduces: then the layer keeps transformers' forward, on our predict and
    correct."""
    original = _original(modeling.Gemma3nTextDecoderLayer, "forward")
    patched = gemma3n_forward.decoder_layer_forward(original, _predict_with_active, _correct_with_active)
    if patched is None:
        warnings.warn("altup_cupy.gemma3n: this transformers release's Gemma3nTextDecoderLayer.forward is not one "
                      "the package reproduces (altup_cupy.gemma3n_forward.KNOWN_LAYER_FORWARDS); the layers keep "
                      "transformers' forward", stacklevel=3)
        return None

    # From transformers 5.23 the layer class's forward is a wrapper that checkpoints the layer's own
    # forward (gradient checkpointing moved there from GradientCheckpointingLayer.__call__); this
    # forward replaces that wrapper, so it checkpoints itself, and falls back on the forward inside.
    checkpoints_in_forward = "__call__" not in vars(_modeling_layers().GradientCheckpointingLayer)
    inner = original.__wrapped__ if checkpoints_in_forward else original

    def serve(self, hidden_states, *args, **kwargs):
        if _left_to_inductor(self, _rows(hidden_states)) or _unserved(
                self, "AltUp predict/correct", (hidden_states, *_predict_weights(self.altup)),
                self.config.altup_num_inputs, hidden_states.shape[-1]):
            return inner(self, hidden_states, *args, **kwargs)
        return patched(self, hidden_states, *args, **kwargs)

    @_replacing("forward")
    def forward(self, hidden_states, *args, **kwargs):
        # As transformers' wrapper: only the forward that module calls checkpoints (a subclass's
        # wrapper around this one, as FSDP2's, checkpoints instead), only while training with
        # gradients, and without the KV cache, which the recomputation would update twice.
        if (checkpoints_in_forward and self.gradient_checkpointing and self.training and torch.is_grad_enabled()
                and getattr(self.forward, "__func__", None) is forward):
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            if not self._can_checkpoint_with_cache:
                kwargs.update({name: None for name in ("cache", "past_key_values", "layer_past") if name in kwargs})
            return self._gradient_checkpointing_func(functools.partial(serve, self, **kwargs), hidden_states, *args)
        return serve(self, hidden_states, *args, **kwargs)

    forward.__doc__, forward.__wrapped__ = original.__doc__, original
    return forward


# ---- the text model's forward, with the expansion and collapse on our operators ----------------

def _expand(model, embeddings: torch.Tensor) -> torch.Tensor:
    return altup.expand(embeddings.contiguous(), [p.weight for p in model.altup_projections])


def _collapse(model, hidden_states: torch.Tensor) -> torch.Tensor:
    return altup.collapse(hidden_states.contiguous(), [p.weight for p in model.altup_unembed_projections])


def _model_forward(modeling):
    """Gemma3nTextModel.forward on our expansion and collapse (`gemma3n_forward`), or None (with a
    warning) where the installed forward is not one that module reproduces."""
    original = _original(modeling.Gemma3nTextModel, "forward")
    patched = gemma3n_forward.text_model_forward(modeling, original, _expand, _collapse)
    if patched is None:
        warnings.warn("altup_cupy.gemma3n: this transformers release's Gemma3nTextModel.forward is not one the "
                      "package reproduces (altup_cupy.gemma3n_forward.KNOWN_FORWARDS); the AltUp expansion and "
                      "collapse stay transformers' own", stacklevel=3)
        return None

    @_replacing("forward")
    def forward(self, *args, **kwargs):
        # the first matrix of each (a model of one stream has none: cuda_serves refuses it first)
        probe = [p.weight for p in (*self.altup_projections[:1], *self.altup_unembed_projections[:1])]
        embeddings = kwargs.get("inputs_embeds")
        if isinstance(embeddings, torch.Tensor):
            probe.append(embeddings)
        if _left_to_inductor(self, _tokens(args, kwargs)) or _unserved(
                self, "AltUp expansion/collapse", probe, self.config.altup_num_inputs, self.config.hidden_size):
            return original(self, *args, **kwargs)
        return patched(self, *args, **kwargs)

    forward.__doc__, forward.__wrapped__ = original.__doc__, original
    return forward


def _tokens(args, kwargs) -> int:
    """Batch x sequence of a Gemma3nTextModel.forward call: input_ids (the first positional argument)
    [B, S] or inputs_embeds [B, S, H]."""
    ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else (args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeddings = kwargs.get("inputs_embeds")
    return embeddings[..., 0].numel() if isinstance(embeddings, torch.Tensor) else 0


def _replacements(modeling) -> dict[tuple[type, str], object]:
    replacements = {(modeling.Gemma3nTextAltUp, "predict"): _predict,
                    (modeling.Gemma3nTextAltUp, "correct"): _correct}
    forward = _model_forward(modeling)
    if forward is not None:
        replacements[(modeling.Gemma3nTextModel, "forward")] = forward
    layer_forward = _layer_forward(modeling)
    if layer_forward is not None:
        replacements[(modeling.Gemma3nTextDecoderLayer, "forward")] = layer_forward
    return replacements


def patch(model: torch.nn.Module | None = None, *, serve_cpu: bool = False,
          compiled_min_tokens: int = COMPILED_MIN_TOKENS) -> None:
    """Route Gemma 3n's AltUp through altup_cupy: every model (model None) or this one instance.
    Compiled calls of fewer than `compiled_min_tokens` tokens keep transformers' code (module
    docstring); 0 serves them all."""
    if isinstance(compiled_min_tokens, bool) or not isinstance(compiled_min_tokens, int) or compiled_min_tokens < 0:
        raise ValueError(f"compiled_min_tokens must be an int >= 0, got {compiled_min_tokens!r}")
    modeling = _modeling()
    replacements = _replacements(modeling)
    if model is None:
        _settings.update(serve_cpu=serve_cpu, compiled_min_tokens=compiled_min_tokens)
        for (cls, name), function in replacements.items():
            _originals.setdefault((cls, name), cls.__dict__[name])
            setattr(cls, name, function)
        return
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Gemma 3n model), got {type(model).__name__}")
    found = False
    for module in model.modules():
        found |= _patch_instance(module, replacements, serve_cpu, compiled_min_tokens)
    if not found:
        raise ValueError(f"model has no Gemma3nTextAltUp, Gemma3nTextDecoderLayer or Gemma3nTextModel module: "
                         f"{type(model).__name__}")


def _patch_instance(module: torch.nn.Module, replacements, serve_cpu: bool, compiled_min_tokens: int) -> bool:
    """Bind the replacements that apply to `module` on it; whether any did. Its class then pickles
    through `_reduce_module`."""
    found = False
    for (cls, name), function in replacements.items():
        if isinstance(module, cls):
            setattr(module, name, MethodType(function, module))
            module.__dict__[_SERVE_CPU] = serve_cpu
            module.__dict__[_COMPILED_MIN_TOKENS] = compiled_min_tokens
            found = True
    if found:
        copyreg.pickle(type(module), _reduce_module)
    return found


def _reduce_module(module: torch.nn.Module):
    """How pickle (torch.save) and copy take a module of a class that patch(model) has bound
    forwards on: as usual, except that a patched module's state is a `_PatchedState`. (A bound
    method pickles as a lookup of its function's name on the module, which finds transformers'
    method, or nothing, when the model is loaded.)"""
    reduced = module.__reduce_ex__(4)
    if _SERVE_CPU not in module.__dict__ or len(reduced) < 3 or not isinstance(reduced[2], dict):
        return reduced
    state = _PatchedState(reduced[2])
    state.module = module
    return (*reduced[:2], state, *reduced[3:])


class _PatchedState(dict):
    """A patched module's state (its `__dict__`) as pickle and copy take it. Pickled, or
    deep-copied, it leaves out the replacements bound on `module` under the names they replace
    (`_replacing`; any other method, e.g. a wrapper's saved forward, pickles as usual) and binds
    this process's replacements again, to the module being built (which exists, its state not
    yet set, by then: pickle and copy build it first). A shallow copy keeps the state as it is,
    as for any module."""

    def __reduce__(self):
        bound = [key for key, value in self.items()
                 if isinstance(value, MethodType) and value.__self__ is self.module
                 and getattr(value.__func__, "altup_cupy_replaces", None) == key]
        return _bind_forwards, (self.module, {key: value for key, value in self.items() if key not in bound}, bound)


def _bind_forwards(module: torch.nn.Module, state: dict, names: list[str]) -> dict:
    """`state` with each of `names` the replacement bound to `module`, or transformers' own method
    where this process's transformers has no replacement for it (the patch's gate on the installed
    forwards)."""
    copyreg.pickle(type(module), _reduce_module)  # saved again, it pickles the same way
    replacements = _replacements(_modeling())
    for name in names:
        function = next((f for (cls, attribute), f in replacements.items()
                         if attribute == name and isinstance(module, cls)), getattr(type(module), name))
        state[name] = MethodType(function, module)
    return state


def unpatch(model: torch.nn.Module | None = None) -> None:
    """Restore transformers' own code: on the classes (model None) or on this instance."""
    modeling = _modeling()
    if model is None:
        for (cls, name), function in list(_originals.items()):
            setattr(cls, name, function)
            del _originals[(cls, name)]
        _settings.update(serve_cpu=False, compiled_min_tokens=COMPILED_MIN_TOKENS)
        return
    for module in model.modules():
        for class_name, names in _PATCHED_ATTRIBUTES.items():
            if isinstance(module, getattr(modeling, class_name)):
                for name in names:
                    module.__dict__.pop(name, None)
                module.__dict__.pop(_SERVE_CPU, None)
                module.__dict__.pop(_COMPILED_MIN_TOKENS, None)
