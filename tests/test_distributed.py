"""The patched Gemma 3n trained by two processes on the CPU (gloo): under DistributedDataParallel and
under FSDP2 (`fully_shard` on every decoder layer and the whole model), against the same AdamW steps
in one process on the whole batch; and `altup_cupy.lab.multi_gpu` run by torchrun on the CPU.

Every run is the `tiny` Gemma3nForCausalLM of altup_cupy.lab.gemma3n_model in float32, patched in
each process (`patch(model, serve_cpu=True)`: the operators' float32 CPU reference), built from the
same seed and trained on the same batches; each rank takes its half of every batch. Each rank's
loss is the mean over its tokens and both halves have as many tokens, so the ranks' average loss is
the whole batch's and the gradients the engines average are the whole batch's gradients. The
AltUp coefficients (std 0.3) stay inside training mode's clip (120): README, "Training on several
GPUs", says what FSDP2 does past it.

Tolerance. The runs do the same float32 arithmetic in different orders: GEMMs and sums over half the
batch, the loss as the mean of two means, the gradients as fl((g0 + g1) / 2) (DDP's all-reduce,
FSDP2's reduce-scatter) instead of one sum over the batch. On this model that moves the first step's
gradients by at most 6e-8 (5e-7 of each tensor's largest gradient) and the losses by at most 2e-7
relative. Losses: rtol 1e-5, 50x that. Parameters: AdamW steps by lr m / (sqrt(v) + eps), m and v
running averages of g and g^2. With the default eps = 1e-8 an element whose gradient is itself at
the level of rounding (a few dozen of this model's 112k are nonzero and below 1e-7) takes a step
that the rounding decides, anywhere in [-lr, lr]: no tolerance below lr could tell a bug from it.
With eps = 1e-3 (the median gradient is ~1.5e-3) the step is Lipschitz in the gradients: a gradient
difference dg moves it by at most about 2 lr dg / eps, 1.2e-10 a step here, far below the float32
spacing of the parameters (1.2e-7 at 1.0), so the final parameters agree to within a few roundings:
rtol 1e-5 (~100 of them), atol 1e-6 (a thousandth of lr, for parameters near 0). Measured: one
rounding at most. Such an eps also keeps the step sensitive to the gradients' scale, which Adam's
normalisation otherwise cancels: a sum over the ranks in place of their mean fails the loss check.
"""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch

if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)
if not torch.distributed.is_gloo_available():
    pytest.skip("this torch build has no gloo backend (torch.distributed on the CPU)", allow_module_level=True)

from gemma3n_support import count_altup_calls, transformers_gemma3n  # noqa: E402

transformers_gemma3n()
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from altup_cupy.lab import multi_gpu  # noqa: E402
from altup_cupy.lab.gemma3n_model import build_model, text_config  # noqa: E402

CONFIG, RANKS, STEPS, BATCH, SEQ = "tiny", 2, 3, 4, 16
ADAMW = dict(lr=1e-3, eps=1e-3, weight_decay=0.01)  # eps: the module docstring says why
LOSS_RTOL = 1e-5
PARAMETER_TOL = dict(rtol=1e-5, atol=1e-6)
TIMEOUT_S = 300  # a hung collective fails the test instead of stalling CI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by its name in the unwrapped model, whole: FSDP2's shards gathered (a
    collective: every rank calls it), DDP's `module.` prefix dropped."""
    from torch.distributed.tensor import DTensor

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def _train(seed: int, engine: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS AdamW steps of the patched model: under `engine` on this rank's shards, or (None) in
    this process alone on the whole batches. Returns the losses and the final parameters."""
    device = torch.device("cpu")
    model = build_model(CONFIG, patched=True, device=device, seed=seed)
    batches = multi_gpu.token_batches(seed, STEPS, BATCH, SEQ, model.config)
    if engine is not None:
        model = multi_gpu.distribute(model, engine, device)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, _ = multi_gpu.train(model, optimizer, multi_gpu.local_batches(batches, device))
    return losses, _full_parameters(model)


def _train_rank(rank: int, engine: str, port: int, seed: int, out_dir) -> None:
    """One rank of the two (torch.multiprocessing.spawn's entry point): trains, then saves its
    losses, parameters and operator calls to out_dir/rank<rank>.pt."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS),
                      LOCAL_RANK=str(rank))
    multi_gpu.init_distributed("cpu")
    try:
        calls = count_altup_calls()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="altup_cupy.gemma3n")  # no fallback to transformers' code
            losses, parameters = _train(seed, engine)
        torch.save(dict(losses=losses, parameters=parameters, calls=calls), out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _train_distributed(engine: str, seed: int, out_dir) -> tuple[list[dict], tuple[list[float], dict]]:
    """Both ranks' results, and the whole-batch reference that this process trains meanwhile."""
    ranks = mp.start_processes(_train_rank, args=(engine, _free_port(), seed, out_dir), nprocs=RANKS, join=False,
                               start_method="spawn")
    try:
        reference = _train(seed, engine=None)
        deadline = time.monotonic() + TIMEOUT_S
        while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):  # raises a rank's error
            if time.monotonic() >= deadline:
                pytest.fail(f"{engine}: the ranks did not finish within {TIMEOUT_S} s")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(RANKS)], reference


@pytest.mark.parametrize("engine", multi_gpu.ENGINES)
def test_two_ranks_train_like_one_process_on_the_whole_batch(engine, seeds, tmp_path):
    ranks, (expected_losses, expected) = _train_distributed(engine, seeds(), tmp_path)
    layers = text_config(CONFIG).num_hidden_layers
    for rank in ranks:  # every forward of every rank went through the operators
        assert rank["calls"] == {"predict": STEPS * layers, "correct": STEPS * layers, "expand": STEPS,
                                 "collapse": STEPS}
        assert rank["losses"] == ranks[0]["losses"]  # each step's loss: the ranks' average
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(expected_losses), rtol=LOSS_RTOL,
                               atol=0.0)
    parameters = ranks[0]["parameters"]
    assert parameters.keys() == expected.keys()
    for name, value in parameters.items():
        torch.testing.assert_close(value, expected[name], **PARAMETER_TOL, msg=lambda m, name=name: f"{name}: {m}")
    if engine == "ddp":  # replicas: the same averaged gradients and a deterministic optimizer on each
        assert all(torch.equal(value, ranks[1]["parameters"][name]) for name, value in parameters.items())


def test_multi_gpu_script_under_torchrun_on_the_cpu(tmp_path):
    """The script's command line as documented, on two CPU processes: a row per step and rank, for
    the unpatched and the patched model, the same loss in both ranks' rows of a step."""
    out = tmp_path / "multi_gpu_fsdp2.csv"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               "-m", "altup_cupy.lab.multi_gpu", "--engine", "fsdp2", "--device", "cpu", "--config", CONFIG,
               "--steps", "2", "--batch", str(BATCH), "--seq", str(SEQ), "--out", str(out), "--no-progress"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S,
                         env={**os.environ, "ALTUP_GIT_SHA": "0123456789ab"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "within the 2% of the one-GPU test" in run.stdout
    with out.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == multi_gpu.COLUMNS
        rows = list(reader)
    assert [(r["patched"], r["step"], r["rank"]) for r in rows] == [
        (p, s, r) for p in "01" for s in "01" for r in "01"]
    for r in rows:
        assert (r["config"], r["engine"], r["gpus"], r["batch"], r["seq"], r["git_sha"]) == (
            CONFIG, "fsdp2", "2", str(BATCH), str(SEQ), "0123456789ab")
        assert float(r["step_ms"]) > 0
    for first, second in zip(rows[::2], rows[1::2]):
        assert first["loss"] == second["loss"]


def test_script_arguments():
    args = multi_gpu.parse_args(["--engine", "ddp"])
    assert (args.config, args.steps, args.batch, args.seq, args.patched) == ("mini", 20, 16, 1024, [0, 1])
    for wrong in (["--engine", "zero3"], ["--engine", "ddp", "--patched", "2"], ["--engine", "ddp", "--steps", "0"]):
        with pytest.raises(SystemExit):
            multi_gpu.parse_args(wrong)


def test_script_outside_torchrun_says_how_to_run_it(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert multi_gpu.main(["--engine", "ddp", "--device", "cpu"]) == 2
    assert "torchrun --nproc-per-node N" in capsys.readouterr().err


def test_a_batch_that_does_not_split_evenly_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match="3 sequences does not split evenly over 2 ranks"):
        multi_gpu.local_batches([torch.zeros(3, 8, dtype=torch.long)], torch.device("cpu"))
