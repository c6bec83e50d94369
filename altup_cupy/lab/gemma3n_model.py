"""Whole-model benchmark: a real transformers Gemma3nForCausalLM, with and without altup_cupy's patch.

    python -m altup_cupy.lab.gemma3n_model --config mini                  # train + prefill, 3 modes, 3 shapes
    python -m altup_cupy.lab.gemma3n_model --config e2b                   # E2B's sizes at 8x1024, eager + compile
    python -m altup_cupy.lab.gemma3n_model --config e2b --regional        # compile the decoder layers one by one
    python -m altup_cupy.lab.gemma3n_model --config mini --modes compile --shapes 1x256 --patched 1
    python -m altup_cupy.lab.gemma3n_model --config e2b --time-limit-s 540 --resume   # run it again to go on
    python -m altup_cupy.lab.gemma3n_model --device cpu --config tiny     # the CPU smoke path (tests)
    python -m altup_cupy bench --suite gemma3n-model --config mini         # the same, through the CLI

Models (random weights, nothing downloaded; patched and unpatched built from the same seed, so
their weights are identical; one model on the device at a time):
- `mini`: hidden 2048, N = 4 AltUp streams, 4 decoder layers (3 sliding-window, 1 full attention),
  8 heads / 2 KV heads of head_dim 256, intermediate 8192, vocabulary 32768 (the per-layer
  embeddings' too), per-layer input 256, LAuReL rank 64, activation sparsity 0.95 on the first two
  layers, bf16.
- `e2b`: the sizes of Gemma 3n E2B's published text config: 30 layers (4 sliding-window then 1
  full attention, repeating; window 512), the last 10 of them sharing KV, intermediate 8192,
  vocabulary 262400 and 262144 per-layer, activation sparsity 0.95 on the first 10 layers (4.4 B
  parameters, ~8.3 GiB of bf16 weights).
- `tiny`: hidden 64, 2 layers (0.1 M parameters), for the CPU path.
Every model's AltUp coefficients (prediction_coefs, correction_coefs) are redrawn with std 0.3:
transformers initialises them near 0, a trained model's are not.

Tasks: `train` is one forward with labels and its backward (no optimizer; gradients are set to None
before each step); `prefill` is one forward of the prompt under no_grad, keeping the logits of the
last position only (as `generate` does) and no KV cache (use_cache=False). Modes: `eager`,
`compile` (torch.compile(model)), `reduce_overhead` (torch.compile(model, mode="reduce-overhead"):
CUDA graphs). With --regional each decoder layer is compiled on its own instead
(`layer.compile()`, the rest of the model eager), for patched and unpatched models alike, and the
mode is written `compile_regional` / `reduce_overhead_regional`. Every case starts from a fresh
model and a reset torch._dynamo. A patched case in which altup_cupy falls back to transformers' code
(its kernels do not serve the call) fails instead of being written as patched.

Columns of results/<gpu>/gemma3n_model.csv (the current directory's, or --out); rows are appended as
each case finishes, so a run cut short keeps its rows and several invocations can fill one file:
- config, task, mode, batch, seq: the case (`mode` carries `_regional` for regional compilation);
- patched: 1 for the model routed through altup_cupy (`altup_cupy.gemma3n.patch(model)`), 0 for
  transformers' own code;
- gpu_ms: the GPU's time for one step, median of --reps: CUDA events around the step, the L2
  flushed before it, the GPU kept asleep until the host has issued the whole step (the harness of
  altup_cupy.lab.bench with a sleep sized by `headstart_for` to outlast the step's host issue), so
  launch and Python overhead stay out. Where a step synchronises the host with the GPU (transformers'
  eager activation-sparsity layers copy a scalar to the device, which waits for the GPU), the host's
  issue after that point is not hidden; the run prints how many such points a step has;
- wall_ms: what a program sees of one step, median of --reps: host clock from the issue to the
  synchronised completion, the GPU idle before it;
- peak_mib: the memory the step needs beyond what was allocated before it (weights, inputs; no
  gradients): peak allocated during one step after warm-up minus allocated just before it. CUDA
  graph replays allocate nothing, so for reduce_overhead it is the larger of that and the peak over
  the warm-up steps (which record the graphs into their memory pool). Each case starts from the
  same state: no compiled code, no cached blocks, no cuBLAS workspace (`_release`);
- git_sha: env ALTUP_GIT_SHA, else `git rev-parse --short=12 HEAD` of the checkout; date: UTC, at
  the start of the invocation.
Beside it, `<out stem>_spread.csv` (`spread_path`) gets one row per case with the same key, git_sha
and date, and how far the --reps steps spread: the 10th and 90th percentiles of the GPU and wall
times (`SPREAD_COLUMNS`). A difference between a patched case and its unpatched twin that lies inside
both ranges is not one a single run can tell apart.
On the CPU (--device cpu) gpu_ms and peak_mib are blank and wall_ms is the host time of a step;
the model runs in float32 and the patch serves CPU tensors through the operators' CPU reference
(`patch(model, serve_cpu=True)`): a test of the benchmark's plumbing, not a measurement.
A case that fails (out of memory, a compile error) writes no row; the error is printed, the run goes
on, and the summary lists the failed cases.
"""

from __future__ import annotations

import argparse
import csv
import gc
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

COLUMNS = ("config", "task", "mode", "patched", "batch", "seq", "gpu_ms", "wall_ms", "peak_mib", "git_sha",
           "date")
SPREAD_COLUMNS = ("config", "task", "mode", "patched", "batch", "seq", "gpu_p10_ms", "gpu_p90_ms", "wall_p10_ms",
                  "wall_p90_ms", "reps", "git_sha", "date")
CONFIGS = ("mini", "e2b", "tiny")
TASKS = ("train", "prefill")
MODES = ("eager", "compile", "reduce_overhead")
COEF_STD = 0.3
DEFAULT_REPS, DEFAULT_WARMUP = 20, 3
# What `--config NAME` runs unless --tasks / --modes / --shapes say otherwise. `all` is mini + e2b.
PLANS = {
    "mini": dict(tasks=TASKS, modes=MODES, shapes=((8, 1024), (1, 4096), (1, 256))),
    "e2b": dict(tasks=TASKS, modes=("eager", "compile"), shapes=((8, 1024),)),
    "tiny": dict(tasks=TASKS, modes=("eager",), shapes=((2, 16),)),
}


# ---- models ---------------------------------------------------------------------------------------

def text_config(name: str):
    """The Gemma3nTextConfig of `name` (mini, e2b or tiny), built here: nothing is downloaded."""
    from transformers import Gemma3nTextConfig

    # What every config shares with E2B (values its published config also states explicitly, so a
    # change of transformers' defaults cannot move them).
    common = dict(altup_num_inputs=4, altup_active_idx=0, altup_coef_clip=120.0, altup_correct_scale=True,
                  rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    width = dict(hidden_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                 hidden_size_per_layer_input=256, laurel_rank=64, sliding_window=512,
                 max_position_embeddings=32768)
    if name == "e2b":
        layers = 30
        return Gemma3nTextConfig(
            **common, **width, num_hidden_layers=layers, intermediate_size=[8192] * layers,
            vocab_size=262400, vocab_size_per_layer_input=262144, num_kv_shared_layers=10,
            layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)],
            activation_sparsity_pattern=[0.95] * 10 + [0.0] * (layers - 10))
    if name == "mini":
        # Four layers cannot hold E2B's 4 + 1 pattern; the last one is full attention so that both
        # kinds of attention are in the step (at 4096 tokens they cost very differently).
        return Gemma3nTextConfig(
            **common, **width, num_hidden_layers=4, intermediate_size=8192, vocab_size=32768,
            vocab_size_per_layer_input=32768, num_kv_shared_layers=0,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0])
    if name == "tiny":
        return Gemma3nTextConfig(
            **common, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            hidden_size_per_layer_input=8, laurel_rank=4, sliding_window=8, max_position_embeddings=512,
            num_hidden_layers=2, intermediate_size=128, vocab_size=256, vocab_size_per_layer_input=256,
            num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
            activation_sparsity_pattern=[0.95, 0.0])
    raise ValueError(f"unknown config {name!r}: one of {CONFIGS}")


def build_model(name: str, *, patched: bool, device: str | torch.device = "cuda", dtype: torch.dtype | None = None,
                seed: int = 0, compiled_min_tokens: int | None = None) -> torch.nn.Module:
    """A Gemma3nForCausalLM of config `name` with random weights, built on `device` (bf16 on CUDA,
    float32 on the CPU unless `dtype`), patched by altup_cupy or not. The same seed gives the same
    weights whether patched or not: the patch rebinds methods and touches no parameter.
    `compiled_min_tokens` (None: the patch's default) is passed to `altup_cupy.gemma3n.patch`."""
    from transformers import Gemma3nForCausalLM

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    # Built in place on the device and in the dtype (as from_pretrained does): E2B's 4.4 B parameters
    # would take minutes to initialise in float32 on the host.
    with torch.device(device):
        model = Gemma3nForCausalLM._from_config(text_config(name), dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.altup.prediction_coefs.weight.normal_(0.0, COEF_STD)
            layer.altup.correction_coefs.weight.normal_(0.0, COEF_STD)
    if patched:
        from .. import gemma3n

        threshold = {} if compiled_min_tokens is None else {"compiled_min_tokens": compiled_min_tokens}
        gemma3n.patch(model, serve_cpu=device.type == "cpu", **threshold)
    return model


def parameter_count(name: str) -> int:
    """Parameters of config `name`, counted on the meta device (no memory, no initialisation)."""
    from transformers import Gemma3nForCausalLM

    with torch.device("meta"):
        model = Gemma3nForCausalLM._from_config(text_config(name), attn_implementation="sdpa")
    return sum(p.numel() for p in model.parameters())


# ---- one step ---------------------------------------------------------------------------------------

def mode_label(mode: str, regional: bool) -> str:
    return f"{mode}_regional" if regional and mode != "eager" else mode


def _runner(model: torch.nn.Module, mode: str, regional: bool) -> Callable:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {MODES}")
    if mode == "eager":
        return model
    options = {"mode": "reduce-overhead"} if mode == "reduce_overhead" else {}
    if not regional:
        return torch.compile(model, **options)
    # The layers share one code object; with parameters as graph inputs they share compiled graphs too,
    # but each distinct layer kind (attention type x sparsity x KV sharing: up to 8 in E2B) is one more
    # recompilation. Past the limit dynamo would run the remaining layers eagerly, unfair to whichever
    # model has more kinds, so the limit is raised above any config's layer count.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for layer in model.model.layers:
        layer.compile(**options)
    return model


def text_token_ids(config, batch: int, seq: int, generator: torch.Generator | int) -> torch.Tensor:
    """[batch, seq] token ids drawn (from `generator`, or a new one seeded with it) above the special
    ones and below both vocabularies: E2B's embedding has 262400 rows, its per-layer embedding 262144
    (the ids past it are the multimodal model's audio and vision tokens), and transformers before
    5.25 looks every id up in both, so a larger id fails on the GPU (a device-side assert). The same
    for patched and unpatched models."""
    if isinstance(generator, int):
        generator = torch.Generator().manual_seed(generator)
    high = min(config.vocab_size, config.vocab_size_per_layer_input)
    return torch.randint(3, high, (batch, seq), generator=generator)


def make_step(model: torch.nn.Module, task: str, mode: str, batch: int, seq: int, *, regional: bool = False,
              seed: int = 0) -> Callable[[], None]:
    """The zero-argument callable that runs one step of `task` on `model` in `mode`; it returns
    nothing, so no output outlives the step."""
    device = next(model.parameters()).device
    ids = text_token_ids(model.config, batch, seq, seed).to(device)
    run = _runner(model, mode, regional)
    # CUDA graph trees reuse their output memory at every replay: marking each step as new tells them
    # the previous step's outputs are dead (without it a training replay errors out).
    new_step = torch.compiler.cudagraph_mark_step_begin if mode == "reduce_overhead" else (lambda: None)
    if task == "train":
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]

        def train_step() -> None:
            for p in params:  # a fresh gradient each step: no accumulation kernels, no growing memory
                p.grad = None
            new_step()
            run(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return train_step
    if task == "prefill":
        model.eval()

        def prefill_step() -> None:
            with torch.no_grad():
                new_step()
                run(input_ids=ids, use_cache=False, logits_to_keep=1)
        return prefill_step
    raise ValueError(f"unknown task {task!r}: one of {TASKS}")


# ---- timing -----------------------------------------------------------------------------------------

def p10_p90(samples: Sequence[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles of `samples` (interpolated between the samples; one sample is
    both)."""
    if len(samples) < 2:
        return samples[0], samples[0]
    cuts = statistics.quantiles(samples, n=10, method="inclusive")
    return cuts[0], cuts[-1]


@dataclass
class Measurement:
    gpu_ms: float | None  # median; None on the CPU
    wall_ms: float  # median
    peak_mib: float | None  # None on the CPU
    host_syncs: int | None  # synchronising CUDA calls in one step; None on the CPU
    gpu_spread: tuple[float, float] | None  # p10_p90 of the GPU times, ms; None on the CPU
    wall_spread: tuple[float, float]  # p10_p90 of the wall times, ms


def _wall_times(step: Callable[[], None], reps: int, cuda: bool) -> list[float]:
    """`reps` wall times of one step, ms."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def _clear_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _peak_mib(step: Callable[[], None], model: torch.nn.Module) -> float:
    _clear_grads(model)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _host_syncs(step: Callable[[], None]) -> int:
    """How many CUDA calls of one step made the host wait for the GPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(model: torch.nn.Module, task: str, mode: str, batch: int, seq: int, *, reps: int = DEFAULT_REPS,
            warmup: int = DEFAULT_WARMUP, regional: bool = False, seed: int = 0) -> Measurement:
    """Time one step of `task` on `model` (on CUDA or the CPU, where its parameters are) in `mode`."""
    step = make_step(model, task, mode, batch, seq, regional=regional, seed=seed)
    cuda = next(model.parameters()).device.type == "cuda"
    if not cuda:
        for _ in range(warmup):
            step()
        wall = _wall_times(step, reps, cuda=False)
        return Measurement(None, statistics.median(wall), None, None, None, p10_p90(wall))

    from .bench import headstart_for, time_us

    # The warm-up compiles (first calls) and records CUDA graphs (reduce-overhead's second or third
    # call): its peak is the graphs' memory, which replays never allocate again.
    _clear_grads(model)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(max(warmup, 1)):
        step()
    torch.cuda.synchronize()
    warmup_peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    # A step issues thousands of launches (tens of ms of host time at E2B's depth): the GPU's sleep
    # before each timed step is sized from the host's issue time of two steps.
    _, host_us = time_us(step, 2, 0)
    gpu_us, _ = time_us(step, reps, 0, headstart_cycles=headstart_for(max(host_us)))
    wall = _wall_times(step, reps, cuda=True)
    peak = _peak_mib(step, model)
    if mode == "reduce_overhead":
        peak = max(peak, warmup_peak)
    syncs = _host_syncs(step)
    _clear_grads(model)
    gpu_ms = [us / 1e3 for us in gpu_us]
    return Measurement(statistics.median(gpu_ms), statistics.median(wall), peak, syncs, p10_p90(gpu_ms),
                       p10_p90(wall))


# ---- cases, rows and the CSV -------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    config: str
    task: str
    mode: str
    patched: int
    batch: int
    seq: int

    def key(self, regional: bool) -> tuple:
        return (self.config, self.task, mode_label(self.mode, regional), str(self.patched), str(self.batch),
                str(self.seq))

    def label(self, regional: bool) -> str:
        return (f"{self.config} {self.task} {mode_label(self.mode, regional)} "
                f"{'patched' if self.patched else 'unpatched'} {self.batch}x{self.seq}")


def plan(configs: Sequence[str], tasks: Sequence[str] | None = None, modes: Sequence[str] | None = None,
         shapes: Sequence[tuple[int, int]] | None = None, patched: Sequence[int] = (0, 1)) -> list[Case]:
    """Every case, config by config and shape by shape, the unpatched and patched model of a case next
    to each other (they compare best measured close in time)."""
    cases = []
    for config in configs:
        default = PLANS[config]
        for batch, seq in shapes or default["shapes"]:
            for task in tasks or default["tasks"]:
                for mode in modes or default["modes"]:
                    cases += [Case(config, task, mode, int(p), batch, seq) for p in patched]
    return cases


def _fmt(x: float | None, digits: int) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _case_key(case: Case, regional: bool) -> dict:
    return dict(config=case.config, task=case.task, mode=mode_label(case.mode, regional), patched=case.patched,
                batch=case.batch, seq=case.seq)


def row(case: Case, m: Measurement, regional: bool, info: dict) -> dict:
    return dict(**_case_key(case, regional), gpu_ms=_fmt(m.gpu_ms, 3), wall_ms=_fmt(m.wall_ms, 3),
                peak_mib=_fmt(m.peak_mib, 1), git_sha=info["git_sha"], date=info["date"])


def spread_row(case: Case, m: Measurement, regional: bool, reps: int, info: dict) -> dict:
    gpu = m.gpu_spread or (None, None)
    return dict(**_case_key(case, regional), gpu_p10_ms=_fmt(gpu[0], 3), gpu_p90_ms=_fmt(gpu[1], 3),
                wall_p10_ms=_fmt(m.wall_spread[0], 3), wall_p90_ms=_fmt(m.wall_spread[1], 3), reps=reps,
                git_sha=info["git_sha"], date=info["date"])


def spread_path(out: Path) -> Path:
    """The spread file beside the CSV `out`: model.csv -> model_spread.csv."""
    out = Path(out)
    return out.with_name(f"{out.stem}_spread{out.suffix}")


def _check_schema(path: Path, columns: Sequence[str]) -> None:
    """A ValueError unless `path` can hold rows of `columns`: a CSV file (not a folder) whose folder
    is one (or can be made), empty or new, or with exactly `columns` as its header, so rows never
    land under another schema's header."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder: --out names the CSV file")
    for folder in path.parents:
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"{path}: {folder} is a file, not a folder")
            break
    if path.exists() and path.stat().st_size:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != tuple(columns):
            raise ValueError(f"{path} has columns {header}, not {list(columns)}: choose another --out")


def check_writable(path: Path, columns: Sequence[str] = COLUMNS) -> None:
    """`_check_schema`, and that the process can write `path`; checked before any case runs."""
    path = Path(path)
    _check_schema(path, columns)
    # Writable, found by opening it for appending (permission bits say nothing on /sys or /proc,
    # or for root); the folder is made now, as the first row would make it, and a new file removed.
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as error:
        raise ValueError(f"{path} cannot be written: {error.strerror or error}") from None
    if not existed:
        path.unlink()


def append_row(path: Path, values: dict, columns: Sequence[str] = COLUMNS) -> None:
    """Append one row (the header first into a new or empty file) after `_check_schema` (the run
    checked that it can write `path` before it began). Opened and closed per row: a killed run
    keeps every finished row."""
    path = Path(path)
    _check_schema(path, columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        writer.writerow(values)


def done_keys(path: Path, git_sha: str) -> set[tuple]:
    """The cases that `path` already holds a row of at `git_sha` (for --resume)."""
    if not Path(path).exists():
        return set()
    with Path(path).open(newline="") as f:
        return {(r["config"], r["task"], r["mode"], r["patched"], r["batch"], r["seq"])
                for r in csv.DictReader(f) if r.get("git_sha") == git_sha}


def recorded_cases(path: Path) -> tuple[dict[tuple, dict], list[str]]:
    """The rows of a gemma3n_model.csv by case, {(config, task, batch, seq, mode, patched): row}, the
    last row of each case counting (a later run of a case supersedes an earlier one), and the commits
    the file's rows come from, in file order."""
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    cases = {(r["config"], r["task"], r["batch"], r["seq"], r["mode"], r["patched"]): r for r in rows}
    return cases, list(dict.fromkeys(r["git_sha"] for r in rows))


def recorded_spreads(path: Path) -> dict[tuple, dict]:
    """The spread rows (`spread_path(path)`) that belong to the rows `recorded_cases(path)` counts: by
    the same case key, for the row of the same git_sha and date; {} where there is no spread file."""
    spread_file = spread_path(path)
    if not spread_file.exists():
        return {}
    counted, _ = recorded_cases(path)
    with spread_file.open(newline="") as f:
        rows = list(csv.DictReader(f))
    spreads = {}
    for r in rows:
        key = (r["config"], r["task"], r["batch"], r["seq"], r["mode"], r["patched"])
        if key in counted and (counted[key]["git_sha"], counted[key]["date"]) == (r["git_sha"], r["date"]):
            spreads[key] = r
    return spreads


def shapes_in_order(cases: dict[tuple, dict]) -> list[tuple]:
    """The (config, task, batch, seq) of `cases`, by config and task, the most tokens first."""
    return sorted({k[:4] for k in cases}, key=lambda k: (k[0], k[1], -int(k[2]) * int(k[3])))


def speedup_table(path: Path) -> str:
    """Markdown: per config, task and shape, the wall time of one step in each mode, patched /
    transformers' own code (the patch's speed-up), from `recorded_cases`; a caption names the commits."""
    cases, commits = recorded_cases(path)
    modes = [m for m in MODES if any(k[4] == m for k in cases)]
    out = ["| config | task | B x S | " + " | ".join(modes) + " |", "|---|---|---|" + "---:|" * len(modes)]
    for config, task, batch, seq in shapes_in_order(cases):
        cells = []
        for mode in modes:
            ours, theirs = (cases.get((config, task, batch, seq, mode, patched)) for patched in ("1", "0"))
            times = " / ".join(f"{float(r['wall_ms']):.1f}" if r else "—" for r in (ours, theirs))
            gain = f" ({float(theirs['wall_ms']) / float(ours['wall_ms']):.2f}×)" if ours and theirs else ""
            cells.append(times + gain)
        out.append(f"| {config} | {task} | {batch} x {seq} | " + " | ".join(cells) + " |")
    caption = (f"`{Path(path).name}`, commits {', '.join(commits)} (the last row of each case counts): wall ms of "
               "one step, patched / transformers' own code (speed-up of the patch); GPU time and peak memory in "
               "the CSV.")
    return caption + "\n\n" + "\n".join(out)


def _release() -> None:
    """Return the last case's memory and compiled code before the next model is built."""
    torch._dynamo.reset()  # first: it drops the compiled graphs and CUDA graph pools holding memory
    gc.collect()
    if torch.cuda.is_available():
        # cuBLAS keeps a workspace per stream for the life of the process, and CUDA graph trees free
        # them while they warm up and record: a workspace left by an earlier case would count in the
        # next case's baseline and then leave it, so that case's reduce-overhead peak would come out
        # lower by the workspaces' size (64 MiB on an H100) than the same case run first. Every case
        # starts without them.
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def run_case(case: Case, *, device: str, reps: int, warmup: int, regional: bool, seed: int,
             compiled_min_tokens: int | None = None) -> Measurement:
    """Build the case's model, measure it, drop it. A patched case in which altup_cupy warns that it
    falls back to transformers' code raises instead: that row would be an unpatched one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="altup_cupy.gemma3n")
        model = build_model(case.config, patched=bool(case.patched), device=device, seed=seed,
                            compiled_min_tokens=compiled_min_tokens)
        try:
            return measure(model, case.task, case.mode, case.batch, case.seq, reps=reps, warmup=warmup,
                           regional=regional, seed=seed)
        finally:
            del model


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        batch, _, seq = item.strip().lower().partition("x")
        if not (batch.isdigit() and seq.isdigit()) or int(batch) < 1 or int(seq) < 1:
            raise argparse.ArgumentTypeError(f"a shape is BATCHxSEQ, e.g. 8x1024; got {item!r}")
        shapes.append((int(batch), int(seq)))
    return shapes


def _parse_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        wrong = [x for x in items if x not in choices]
        if wrong or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items
    return parse


def _parse_patched(text: str) -> list[int]:
    return [int(x) for x in _parse_list(("0", "1"))(text)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m altup_cupy.lab.gemma3n_model",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=(*CONFIGS, "all"), default=None,
                        help="which model (all: mini then e2b; tiny is for --device cpu; default: all on "
                             "cuda, tiny on cpu)")
    parser.add_argument("--tasks", type=_parse_list(TASKS), default=None,
                        help="comma-separated, of train,prefill (default: both)")
    parser.add_argument("--modes", type=_parse_list(MODES), default=None,
                        help="comma-separated, of eager,compile,reduce_overhead (default: mini all three, "
                             "e2b eager,compile, tiny eager)")
    parser.add_argument("--shapes", type=_parse_shapes, default=None,
                        help="comma-separated BATCHxSEQ (default: mini 8x1024,1x4096,1x256; e2b 8x1024; tiny 2x16)")
    parser.add_argument("--patched", type=_parse_patched, default=[0, 1], help="0, 1 or 0,1 (default 0,1)")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed steps per case (median)")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                        help="untimed steps first (they compile and record CUDA graphs)")
    parser.add_argument("--regional", action="store_true",
                        help="compile each decoder layer (layer.compile()) instead of the whole model")
    parser.add_argument("--compiled-min-tokens", type=int, default=None,
                        help="the patch's compiled_min_tokens (default: altup_cupy.gemma3n.COMPILED_MIN_TOKENS; "
                             "0 runs the operators in every compiled case: write those rows to another --out)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help="the CSV to append to (default: results/<gpu>/gemma3n_model.csv under the current "
                             "directory)")
    parser.add_argument("--resume", action="store_true",
                        help="skip the cases that --out already holds a row of at this git sha")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="start no case that would end past this many seconds from the start (estimated "
                             "from the last case of the same config, task and mode); the rows so far are kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    if args.compiled_min_tokens is not None and args.compiled_min_tokens < 0:
        parser.error("--compiled-min-tokens must be >= 0")
    if args.time_limit_s is not None and args.time_limit_s < 0:
        parser.error("--time-limit-s must be >= 0")
    if args.config is None:
        args.config = "tiny" if args.device == "cpu" else "all"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    from .._extras import MissingExtraError, require
    from .bench import run_info
    from .paths import results_dir

    try:
        tqdm = require("tqdm.auto", "bench", "tqdm").tqdm
        transformers = require("transformers", "gemma3n")
    except MissingExtraError as error:
        print(f"gemma3n_model: {error}", file=sys.stderr)
        return 1

    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu --config tiny for the CPU smoke path)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = args.out if args.out is not None else results_dir(device_name) / "gemma3n_model.csv"
    try:
        check_writable(out, COLUMNS)
        check_writable(spread_path(out), SPREAD_COLUMNS)
    except ValueError as error:
        print(f"gemma3n_model: --out: {error}", file=sys.stderr)
        return 2
    info = run_info()
    configs = ("mini", "e2b") if args.config == "all" else (args.config,)
    cases = plan(configs, args.tasks, args.modes, args.shapes, args.patched)
    done = done_keys(out, info["git_sha"]) if args.resume else set()
    todo = [c for c in cases if c.key(args.regional) not in done]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device_name}, git {info['git_sha']}; "
          f"{len(todo)} cases ({len(cases) - len(todo)} already in {out}); reps {args.reps}, warm-up {args.warmup}"
          f"{', regional compilation' if args.regional else ''}", flush=True)
    for config in configs:
        print(f"  {config}: {parameter_count(config):,} parameters", flush=True)

    written, failed, skipped = [], [], []
    last_seconds: dict[tuple, float] = {}
    bar = tqdm(todo, desc="gemma3n model", file=sys.stderr, disable=args.no_progress)
    for case in bar:
        label = case.label(args.regional)
        estimate = last_seconds.get((case.config, case.task, case.mode), 0.0)
        if args.time_limit_s is not None and time.monotonic() - start + estimate > args.time_limit_s:
            skipped.append(label)
            continue
        bar.set_postfix_str(label)
        _release()  # the previous case's compiled code and cached blocks
        t0 = time.monotonic()
        try:
            m = run_case(case, device=args.device, reps=args.reps, warmup=args.warmup, regional=args.regional,
                         seed=args.seed, compiled_min_tokens=args.compiled_min_tokens)
        except Exception as error:  # noqa: BLE001  (out of memory, a compile error: the other cases still run)
            failed.append(label)
            bar.write(f"FAILED {label}: {type(error).__name__}: {str(error)[:500]}")
            continue
        finally:
            last_seconds[(case.config, case.task, case.mode)] = time.monotonic() - t0
            _release()
        values = row(case, m, args.regional, info)
        append_row(out, values)
        spread = spread_row(case, m, args.regional, args.reps, info)
        append_row(spread_path(out), spread, SPREAD_COLUMNS)
        written.append(label)
        note = f", {m.host_syncs} host syncs per step" if m.host_syncs else ""
        gpu_spread = f" ({spread['gpu_p10_ms']}-{spread['gpu_p90_ms']})" if m.gpu_spread else ""
        bar.write(f"{label}: GPU {values['gpu_ms'] or '-'}{gpu_spread} ms, wall {values['wall_ms']} "
                  f"({spread['wall_p10_ms']}-{spread['wall_p90_ms']}) ms, peak {values['peak_mib'] or '-'} MiB{note}"
                  " (median, p10-p90 in brackets)")
    bar.close()

    print(f"\n{len(written)} rows appended to {out} (their spread to {spread_path(out).name}) in "
          f"{time.monotonic() - start:.0f} s")
    if skipped:
        print(f"not started (time limit {args.time_limit_s:.0f} s): {len(skipped)}; run again with --resume to go on")
        for label in skipped:
            print(f"  {label}")
    if failed:
        print(f"FAILED: {len(failed)}")
        for label in failed:
            print(f"  {label}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
