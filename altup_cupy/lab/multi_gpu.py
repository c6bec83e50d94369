"""Training the patched Gemma 3n across GPUs: DistributedDataParallel or FSDP2, patched and unpatched.

    torchrun --nproc-per-node 2 -m altup_cupy.lab.multi_gpu --engine ddp --steps 20
    torchrun --nproc-per-node 2 -m altup_cupy.lab.multi_gpu --engine fsdp2 --steps 20
    torchrun --nproc-per-node 2 -m altup_cupy.lab.multi_gpu --engine ddp --device cpu --config tiny --steps 2

Each process builds the same model (`altup_cupy.lab.gemma3n_model.build_model`: random weights from
--seed, bf16 on CUDA, float32 on the CPU), wraps it for the engine and runs --steps AdamW steps
(lr --lr, weight decay 0.01), first unpatched, then patched (`--patched` picks), each from the
same initial weights on the same batches:
- `ddp`: `torch.nn.parallel.DistributedDataParallel` (NCCL on CUDA, gloo on the CPU): every rank
  holds the whole model, gradients are averaged over the ranks during the backward.
- `fsdp2`: `torch.distributed.fsdp.fully_shard` on every decoder layer and on the whole model:
  each rank holds 1 / ranks of every parameter, a layer's parameters are all-gathered before it
  runs and its gradients reduce-scattered (averaged) after its backward.
Step k trains on batch k of a token stream drawn from --seed: --batch sequences of --seq tokens,
split into equal contiguous shards, one a rank. Each rank's loss is the mean over its tokens, so
the mean over the ranks (the `loss` written) is the mean over the whole batch: the loss one
process would see on the full batch, whatever the number of GPUs.
A patched run in which altup_cupy warns that it falls back to transformers' code (its kernels do
not serve the call) stops with an error: it would be an unpatched run.

Rows appended to results/<gpu>/multi_gpu_<engine>.csv (under the current directory, or --out), by
rank 0, one per step and rank: config, engine, patched (1: `altup_cupy.gemma3n.patch`), gpus (the
number of ranks), rank, step, batch, seq, loss (the mean over the whole batch, the same in every
rank's row), step_ms (this rank's host clock around the forward, backward and optimizer step,
synchronised with the GPU at both ends; the first steps include compilation and allocation: the
summary leaves --warmup steps out), git_sha and date (UTC) of the run. At the end rank 0 prints
how far apart the patched and unpatched losses are, step by step (against the 2% of the one-GPU
convergence test), and the ratio of their step times (the slowest rank's median).
On the CPU (--device cpu: gloo, float32, the patch serving CPU tensors through the operators'
reference) the run tests the plumbing; its times are no measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .._extras import require
from .bench import run_info
from .gemma3n_model import append_row, build_model, check_writable, text_token_ids
from .paths import results_dir

ENGINES = ("ddp", "fsdp2")
CONFIGS = ("mini", "tiny")
COLUMNS = ("config", "engine", "patched", "gpus", "rank", "step", "batch", "seq", "loss", "step_ms", "git_sha",
           "date")
WEIGHT_DECAY = 0.01
# tests/test_gemma3n_gpu.py::test_training_converges_like_transformers: on one GPU, the patched
# model's bf16 losses stay within 2% of transformers' own, step by step.
LOSS_RTOL = 0.02


def init_distributed(device_type: str) -> torch.device:
    """Join the process group that torchrun (or the caller) describes in RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT: NCCL with this process's GPU (LOCAL_RANK) on CUDA, gloo on the
    CPU. Returns the device this rank trains on."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def distribute(model: torch.nn.Module, engine: str, device: torch.device) -> torch.nn.Module:
    """`model` (a Gemma3nForCausalLM on `device`) under `engine`, for every rank of the process group."""
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # One group per decoder layer, so that only one layer's parameters are gathered at a time;
        # the root group keeps what the layers share (embeddings, AltUp projections, the tied head).
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    raise ValueError(f"unknown engine {engine!r}: one of {ENGINES}")


def token_batches(seed: int, steps: int, batch: int, seq: int, config) -> list[torch.Tensor]:
    """The whole batch of every step, [batch, seq] token ids of the model `config` describes
    (`gemma3n_model.text_token_ids`), drawn on the CPU from `seed`: the same on every rank and for
    any number of ranks."""
    generator = torch.Generator().manual_seed(seed)
    return [text_token_ids(config, batch, seq, generator) for _ in range(steps)]


def local_batches(batches: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """This rank's shard of every batch (all of it outside a process group), on `device`. The shards
    are equal, so the mean of the ranks' mean losses is the mean loss of the whole batch."""
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if batches and batches[0].shape[0] % ranks:
        raise ValueError(f"a batch of {batches[0].shape[0]} sequences does not split evenly over {ranks} ranks")
    return [b.chunk(ranks)[rank].to(device) for b in batches]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    if not dist.is_initialized():
        return loss.item()
    total = loss.detach().clone()
    dist.all_reduce(total)  # a sum: gloo has no average
    return total.item() / dist.get_world_size()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[torch.Tensor],
          on_step: Callable[[float], None] | None = None) -> tuple[list[float], list[float]]:
    """One optimizer step per batch (`batches`: this rank's, on the model's device). Returns the loss
    of every step, averaged over the ranks, and this rank's time of every step in ms."""
    device = batches[0].device
    model.train()
    losses, step_ms = [], []
    for ids in batches:
        _synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        step_ms.append(1e3 * (time.perf_counter() - start))
        # Outside the timed step; it also lines the ranks up before the next one starts.
        losses.append(_mean_over_ranks(loss))
        if on_step is not None:
            on_step(losses[-1])
    return losses, step_ms


def _all_ranks(values: Sequence[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (the same length on each), indexed by rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [t.tolist() for t in gathered]


def _train_flavour(args: argparse.Namespace, patched: bool, device: torch.device, progress) -> tuple[list, list]:
    """Build, distribute and train one model; returns (losses, every rank's step times)."""
    with warnings.catch_warnings():
        if patched:  # a fallback to transformers' code would make this an unpatched run
            warnings.filterwarnings("error", message="altup_cupy.gemma3n")
        model = build_model(args.config, patched=patched, device=device, seed=args.seed)
        batches = token_batches(args.seed, args.steps, args.batch, args.seq, model.config)
        model = distribute(model, args.engine, device)
        # Made after `distribute`: FSDP2 replaces the parameters by their shards.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
        losses, step_ms = train(model, optimizer, local_batches(batches, device), on_step=progress)
    return losses, _all_ranks(step_ms, device)


def _median_step_ms(step_ms: Sequence[float], warmup: int) -> float:
    return statistics.median(step_ms[warmup:] or step_ms)


def _parse_patched(text: str) -> list[int]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(v not in ("0", "1") for v in values):
        raise argparse.ArgumentTypeError(f"0, 1 or 0,1; got {text!r}")
    return [int(v) for v in values]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m altup_cupy.lab.multi_gpu",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--config", choices=CONFIGS, default="mini",
                        help="the model of altup_cupy.lab.gemma3n_model (tiny is for --device cpu)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16,
                        help="sequences per step over all ranks (split evenly; default 16: 8 a GPU on two)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--patched", type=_parse_patched, default=[0, 1], help="0, 1 or 0,1 (default 0,1)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the summary's step times")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help="the CSV to append to (default: results/<gpu>/multi_gpu_<engine>.csv under the "
                             "current directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2 or args.warmup < 0:
        parser.error("--steps and --batch must be >= 1, --seq >= 2 (a next token to predict), --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        print("run it under torchrun: torchrun --nproc-per-node N -m altup_cupy.lab.multi_gpu ...", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA GPUs (or --device cpu --config tiny for the CPU path)", file=sys.stderr)
        return 2
    tqdm = require("tqdm.auto", "bench").tqdm
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"  # one GPU model a host
    out = args.out if args.out is not None else results_dir(device_name) / f"multi_gpu_{args.engine}.csv"
    if os.environ.get("RANK", "0") == "0":  # the rank that writes the rows; torchrun ends the others
        try:
            check_writable(out, COLUMNS)
        except ValueError as error:
            print(f"multi_gpu: --out: {error}", file=sys.stderr)
            return 2
    device = init_distributed(args.device)
    try:
        rank, ranks = dist.get_rank(), dist.get_world_size()
        info = run_info()
        if rank == 0:
            print(f"{args.engine} on {ranks} x {device_name}, {args.config}, {args.steps} steps of "
                  f"{args.batch}x{args.seq} tokens, git {info['git_sha']}", flush=True)
        results = {}
        for patched in args.patched:
            label = "patched" if patched else "unpatched"
            bar = tqdm(total=args.steps, desc=f"{args.engine} {label}", file=sys.stderr,
                       disable=rank != 0 or args.no_progress)

            def progress(loss: float, bar=bar) -> None:
                bar.update()
                bar.set_postfix(loss=f"{loss:.4f}")

            losses, step_ms = _train_flavour(args, bool(patched), device, progress)
            bar.close()
            results[patched] = losses, step_ms
            if rank == 0:
                for step, loss in enumerate(losses):
                    for r in range(ranks):
                        append_row(out, dict(config=args.config, engine=args.engine, patched=patched, gpus=ranks,
                                             rank=r, step=step, batch=args.batch, seq=args.seq, loss=f"{loss:.6f}",
                                             step_ms=f"{step_ms[r][step]:.3f}", git_sha=info["git_sha"],
                                             date=info["date"]), columns=COLUMNS)
                medians = ", ".join(f"{_median_step_ms(t, args.warmup):.1f}" for t in step_ms)
                print(f"{label}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; median step ms by rank: {medians}",
                      flush=True)
        if rank == 0:
            print(f"{args.steps * ranks * len(args.patched)} rows appended to {out}")
            if len(results) == 2:
                _compare(results[0], results[1], args.warmup)
        # Every rank done before any tears the group down: a gloo rank destroying its group while
        # another still runs aborted both processes at exit ("terminate called without an active
        # exception"), after all their work.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _compare(unpatched: tuple[list, list], patched: tuple[list, list], warmup: int) -> None:
    """Print how far the patched losses are from the unpatched ones and the step time ratio (of the
    slowest rank: the step of every rank waits for it)."""
    worst = max(abs(p - u) / abs(u) for p, u in zip(patched[0], unpatched[0]))
    print(f"patched vs unpatched loss: at most {100 * worst:.3f}% apart "
          f"({'within' if worst <= LOSS_RTOL else 'OUTSIDE'} the {100 * LOSS_RTOL:.0f}% of the one-GPU test)")
    slowest = [max(_median_step_ms(t, warmup) for t in run[1]) for run in (unpatched, patched)]
    print(f"step (slowest rank's median): unpatched {slowest[0]:.1f} ms, patched {slowest[1]:.1f} ms, "
          f"{slowest[0] / slowest[1]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
