"""The benchmark's workloads, its input distributions and its tolerance rule (docs/SPEC.md section 3).

`workloads.json` (shipped in the package) holds the 16 workloads of each
op with their tolerances. A second suite, `gemma3n`, uses the real checkpoints' shapes (N = 4,
H = 2048 for E2B and 2560 for E4B) with the tolerance of the benchmark workload nearest in M.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

OPS = ("collapse", "predict_correct_backward")
SUITES = ("benchmark", "gemma3n")
MIN_MATCH_RATIO = 0.99
GEMMA3N_HIDDEN = (2048, 2560)
GEMMA3N_TOKENS = ((1, 128), (4, 512), (8, 1024))


@dataclass(frozen=True)
class Workload:
    op: str
    streams: int  # N
    hidden: int  # H
    batch_size: int
    seq_len: int
    atol: float
    rtol: float
    eps: float
    active_idx: int = 0

    @property
    def tokens(self) -> int:  # M
        return self.batch_size * self.seq_len

    @property
    def label(self) -> str:
        return f"N{self.streams}_H{self.hidden}_B{self.batch_size}_S{self.seq_len}"


@lru_cache(maxsize=None)
def _spec() -> dict:
    return json.loads((Path(__file__).with_name("workloads.json")).read_text())


def benchmark_workloads(op: str) -> list[Workload]:
    """The 16 workloads of the benchmark, in its order."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    section = _spec()[op]
    constants = section["constants"]
    if op == "collapse":
        eps, active = constants["epsilon"], 0
    else:
        eps, active = constants["rms_norm_eps"], constants["altup_active_idx"]
    return [
        Workload(op, constants["altup_num_inputs"], constants["hidden_size"], w["batch_size"],
                 w["seq_len"], w["max_atol"], w["max_rtol"], eps, active)
        for w in section["workloads"]
    ]


def gemma3n_workloads(op: str) -> list[Workload]:
    """Gemma 3n's own shapes: N = 4, H = 2048 (E2B) and 2560 (E4B), a few token counts."""
    bench = benchmark_workloads(op)
    result = []
    for hidden in GEMMA3N_HIDDEN:
        for batch, seq in GEMMA3N_TOKENS:
            nearest = min(bench, key=lambda w: abs(math.log(w.tokens / (batch * seq))))
            result.append(replace(nearest, streams=4, hidden=hidden, batch_size=batch, seq_len=seq))
    return result


def workloads(op: str, suite: str = "benchmark") -> list[Workload]:
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
    return benchmark_workloads(op) if suite == "benchmark" else gemma3n_workloads(op)


@dataclass(frozen=True)
class ToleranceReport:
    """One output against its float64 reference."""

    match_ratio: float  # fraction of elements with |out - ref| <= atol + rtol * |ref|
    rel_l2: float  # ||out - ref|| / ||ref||
    finite: bool  # no NaN or Inf anywhere in out

    @property
    def passed(self) -> bool:
        """The benchmark's rule: at least 99% of elements match and nothing is NaN or Inf."""
        return self.finite and self.match_ratio >= MIN_MATCH_RATIO


def tolerance_report(out, ref, atol: float, rtol: float) -> ToleranceReport:
    """Compare a torch tensor `out` (any dtype) with a float64 tensor `ref` of the same shape."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: output {tuple(out.shape)}, reference {tuple(ref.shape)}")
    if ref.numel() == 0:
        return ToleranceReport(1.0, 0.0, True)
    o = out.to(torch.float64)
    r = ref.to(torch.float64)
    diff = (o - r).abs()
    matched = (diff <= atol + rtol * r.abs()).double().mean().item()
    ref_norm = torch.linalg.vector_norm(r).item()
    err_norm = torch.linalg.vector_norm(o - r).item()
    rel = err_norm / ref_norm if ref_norm > 0 else err_norm
    return ToleranceReport(matched, rel, bool(torch.isfinite(o).all().item()))


def _randn(shape, generator, device, scale: float = 1.0):
    import torch

    x = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return (x * scale if scale != 1.0 else x).to(torch.bfloat16)


def collapse_inputs(w: Workload, seed: int, device="cuda") -> dict:
    """Fresh inputs drawn as the benchmark draws them: randn activations, randn (std 1) weights."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return {
        "hidden_states": _randn((w.streams, w.batch_size, w.seq_len, w.hidden), g, device),
        "unembed_projs": _randn((w.streams - 1, w.hidden, w.hidden), g, device),
        "eps": w.eps,
    }


def predict_correct_backward_inputs(w: Workload, seed: int, device="cuda", norm_weight: str = "ones") -> dict:
    """Fresh inputs drawn as the benchmark draws them; norm_weight "ones" or "random" (randn+1)."""
    import torch

    if norm_weight not in ("ones", "random"):
        raise ValueError(f"norm_weight must be 'ones' or 'random', got {norm_weight!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    n, h = w.streams, w.hidden
    tokens = (w.batch_size, w.seq_len, h)
    inputs = {
        "grad_corrected": _randn((n, *tokens), g, device),
        "hidden_states": _randn((n, *tokens), g, device),
        "activated": _randn(tokens, g, device),
        "prediction_coefs": _randn((n * n, n), g, device, 1.0 / math.sqrt(n)),
        "correction_coefs": _randn((n, n), g, device, 1.0 / math.sqrt(n)),
        "router_weight": _randn((n, h), g, device, 1.0 / math.sqrt(h)),
    }
    if norm_weight == "ones":
        inputs["norm_weight"] = torch.ones(h, device=device, dtype=torch.bfloat16)
    else:
        inputs["norm_weight"] = (torch.randn(h, generator=g, device=device) + 1.0).to(torch.bfloat16)
    inputs["active_idx"] = w.active_idx
    inputs["eps"] = w.eps
    return inputs
