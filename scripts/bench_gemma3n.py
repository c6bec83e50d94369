"""Gemma 3n's AltUp with altup_cupy on a CUDA GPU: the GPU tests, then the speed of a training step.

    python scripts/bench_gemma3n.py            # tests (log) + speed CSV
    python scripts/bench_gemma3n.py --quick    # a short run: fewer shapes, repetitions and tests
    python scripts/bench_gemma3n.py --no-tests # speed only
    python scripts/bench_gemma3n.py --no-tests --parts kernels   # only the row kernels
    ncu --clock-control none -k regex:altup_predict_backward -s 1 \
        python scripts/bench_gemma3n.py --profile predict_backward_v2   # one kernel for a profiler

Speed: the AltUp part of one training step (forward + backward) at Gemma 3n E2B's sizes (N = 4,
H = 2048, 30 layers): the expansion, every layer's predict and correct (the layer proper between
them is left out: `activated` is the active prediction itself), the collapse. Three versions of
the same code:
- `altup_cupy`: transformers' Gemma3nTextAltUp modules patched by altup_cupy.gemma3n, and
  altup_cupy.torch's expand / collapse;
- `transformers_eager`: the unpatched modules; the expansion and collapse, which transformers
  writes inline in Gemma3nTextModel.forward, run as the same torch ops in the model dtype
  (altup_cupy.reference.gemma3n in bf16);
- `torch_compile`: torch.compile of `transformers_eager`.
Plus one whole training step (forward, backward, AdamW) of a small Gemma3nForCausalLM with and
without the patch. GPU time: CUDA events around each call, L2 flushed before it, median (the
harness of altup_cupy.lab.bench, the GPU's sleep before each call outlasting the call's host issue);
wall time: host clock from issue to completion (synchronised), median. Rows go to results/<gpu name>/gemma3n_training_step.csv of the current directory (or --out),
the test log next to them as gemma3n_gpu_tests.log.

Kernels: each row kernel of altup_cupy.ops.gemma3n_altup_versions (predict and correct, forward and backward;
the expansion's epilogue and the magnitude-match backward; every version of a kernel that has
several, as `<step>_v<version>`) alone at M = 256, 1024, 4096 and 8192 tokens, GPU time against a
plain device copy of the bytes it must move (`vs_copy_floor`), in gemma3n_kernels.csv next to the
training-step CSV.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))

import altup_cupy.gemma3n as gemma3n  # noqa: E402
from altup_cupy.ops import gemma3n_altup_versions as kernels  # noqa: E402
from altup_cupy import torch as altup  # noqa: E402
from altup_cupy.lab.bench import copy_floor, headstart_for, run_info, time_us, write_csv  # noqa: E402
from altup_cupy.lab.paths import results_dir  # noqa: E402
from altup_cupy.reference import gemma3n as ref  # noqa: E402
from gemma3n_support import tiny_text_config  # noqa: E402
from transformers.models.gemma3n import modeling_gemma3n as modeling  # noqa: E402

STREAMS, HIDDEN, LAYERS = 4, 2048, 30  # Gemma 3n E2B
SHAPES = [(8, 1024), (1, 4096), (1, 256)]
QUICK_SHAPES = [(1, 4096), (1, 256)]
COLUMNS = ("what", "impl", "N", "H", "layers", "batch_size", "seq_len", "tokens", "gpu_median_us",
           "gpu_p10_us", "gpu_p90_us", "wall_median_us", "gpu", "git_sha", "date")
PARTS = ("kernels", "altup_step", "model_step")
KERNEL_TOKENS = (256, 1024, 4096, 8192)
KERNEL_COLUMNS = ("kernel", "N", "H", "tokens", "compulsory_bytes", "gpu_median_us", "copy_floor_us",
                  "vs_copy_floor", "tbps", "gpu", "git_sha", "date")


class AltUpStack(torch.nn.Module):
    """The AltUp part of a Gemma 3n text model, its parameters shaped and initialised as there."""

    def __init__(self, layers: int, hidden: int, ours: bool):
        super().__init__()
        config = tiny_text_config(streams=STREAMS, hidden=hidden)
        self.ours = ours
        self.altups = torch.nn.ModuleList(modeling.Gemma3nTextAltUp(config) for _ in range(layers))
        self.expand_proj = self._projections(hidden)
        self.collapse_proj = self._projections(hidden)
        with torch.no_grad():
            for module in self.altups:
                module.prediction_coefs.weight.normal_(0.0, 0.5)
                module.correction_coefs.weight.normal_(0.0, 0.5)

    @staticmethod
    def _projections(hidden):
        return torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(STREAMS - 1))

    def forward(self, embeddings):
        expand_w = [p.weight for p in self.expand_proj]
        collapse_w = [p.weight for p in self.collapse_proj]
        if self.ours:
            hidden_states = altup.expand(embeddings, expand_w)
        else:
            hidden_states = ref.expand_forward(embeddings, expand_w, dtype=embeddings.dtype)
        for module in self.altups:
            predictions = module.predict(hidden_states)
            hidden_states = module.correct(predictions, predictions[module.config.altup_active_idx])
        if self.ours:
            return altup.collapse(hidden_states, collapse_w)
        return ref.collapse_forward(hidden_states, collapse_w, dtype=hidden_states.dtype)


def _training_call(model, inputs, grad):
    params = list(model.parameters())

    def call():
        for p in params:
            p.grad = None
        model(inputs).backward(grad)

    return call


def _wall_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times)


def _row(what, impl, layers, batch, seq, fn, reps, warmup, info):
    # A step issues thousands of launches: the GPU sleeps long enough for the host to issue it all.
    _, host = time_us(fn, 2, warmup)
    gpu, _ = time_us(fn, reps, 0, headstart_cycles=headstart_for(max(host)))
    q = statistics.quantiles(gpu, n=10)
    row = dict(what=what, impl=impl, N=STREAMS, H=HIDDEN, layers=layers, batch_size=batch, seq_len=seq,
               tokens=batch * seq, gpu_median_us=f"{statistics.median(gpu):.1f}", gpu_p10_us=f"{q[0]:.1f}",
               gpu_p90_us=f"{q[-1]:.1f}", wall_median_us=f"{_wall_us(fn, reps):.1f}", **info)
    print(f"{what:>14} {impl:>20} {batch}x{seq}: GPU {row['gpu_median_us']} us, wall {row['wall_median_us']} us",
          flush=True)
    return row


def bench_altup_step(shapes, reps, warmup, info):
    rows = []
    torch.manual_seed(0)
    eager = AltUpStack(LAYERS, HIDDEN, ours=False).to("cuda", torch.bfloat16).train()
    ours = copy.deepcopy(eager)
    ours.ours = True
    gemma3n.patch(ours)
    compiled = torch.compile(eager)
    for batch, seq in shapes:
        x = torch.randn(batch, seq, HIDDEN, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        grad = torch.randn(batch, seq, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for impl, model in (("altup_cupy", ours), ("transformers_eager", eager), ("torch_compile", compiled)):
            row = _guarded(lambda: _row("altup_step", impl, LAYERS, batch, seq, _training_call(model, x, grad),
                                        reps, warmup, info), f"{impl} {batch}x{seq}")
            rows += [row] if row else []
    return rows


def _guarded(measure, what):
    """One measurement; a failure (out of memory, a compile error) is reported and skipped, not fatal."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001  (the other rows are still worth having)
        print(f"FAILED {what}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        return None
    finally:
        torch.cuda.empty_cache()


def _optimizer_step(model, ids):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench_model_step(reps, warmup, info, batch=4, seq=1024):
    """One AdamW training step of a small Gemma3nForCausalLM (E2B's width, 4 layers)."""
    config = tiny_text_config(streams=STREAMS, hidden=HIDDEN, layers=4, vocab_size=8192,
                              vocab_size_per_layer_input=8192, intermediate_size=8192, num_attention_heads=8,
                              head_dim=256, hidden_size_per_layer_input=256, laurel_rank=64, sliding_window=512,
                              max_position_embeddings=seq)
    torch.manual_seed(0)
    base = modeling.Gemma3nForCausalLM(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(3, config.vocab_size, (batch, seq), device="cuda")
    rows = []
    for impl in ("transformers_eager", "altup_cupy"):
        model = copy.deepcopy(base)
        if impl == "altup_cupy":
            gemma3n.patch(model)
        step = _optimizer_step(model, ids)
        row = _guarded(lambda: _row("model_step", impl, config.num_hidden_layers, batch, seq, step, reps, warmup,
                                    info), f"model step {impl}")
        rows += [row] if row else []
    return rows


def _kernel_cases(tokens: int):
    """(kernel, call, compulsory bytes) for each row kernel at N = STREAMS, H = HIDDEN: the rows it
    must read and write once (bf16 2 bytes, fp32 projections 4; the small weights left out). The
    correct backward reads one prediction row, the active one: g (N rows), x and pred_a in, the
    N + 1 gradients out, 2N + 3 rows. The `_with_active` rows also read grad_active, one row more."""
    n, h, m = STREAMS, HIDDEN, tokens
    eps, scale, floor, active = 1e-6, 1.0 / HIDDEN, 1e-5, 0
    device = torch.cuda.current_device()

    def bf16(*shape):
        return torch.randn(*shape, device="cuda").to(torch.bfloat16)

    streams, grad, activated, grad_active = bf16(n, 1, m, h), bf16(n, 1, m, h), bf16(1, m, h), bf16(1, m, h)
    P, Q, R, w = bf16(n * n, n), bf16(n, n), bf16(n, h), 1 + 0.1 * bf16(h)
    x0, projected = bf16(m, h), torch.randn(m, (n - 1) * h, device="cuda")
    expanded, grad_projected = torch.empty_like(streams), torch.empty(m, (n - 1) * h, device="cuda").bfloat16()
    grad_base = torch.empty(m, h, device="cuda")
    row = 2 * m * h  # one bf16 row per token
    return [
        ("predict_forward", lambda: kernels.predict_forward(streams, P, R, w, active, eps, scale), 2 * n * row),
        ("correct_forward", lambda: kernels.correct_forward(streams, activated, Q, R, w, active, eps, scale),
         (2 * n + 1) * row),
        *((f"predict_backward_v{v}", lambda v=v: kernels.predict_backward(grad, streams, P, R, w, active, eps, scale, v),
           3 * n * row) for v in range(1, len(kernels.KERNELS["predict_backward"]) + 1)),
        *((f"correct_backward_v{v}", lambda v=v: kernels.correct_backward(grad, streams, activated, Q, R, w, active, eps,
                                                                         scale, v),
           (2 * n + 3) * row) for v in range(1, len(kernels.KERNELS["correct_backward"]) + 1)),
        # as the patched model calls them: the active row's gradient also arrives apart (one more row)
        *((f"predict_backward_v{v}_with_active", lambda v=v: kernels.predict_backward(
            grad, streams, P, R, w, active, eps, scale, v, grad_active=grad_active), (3 * n + 1) * row)
          for v in range(1, len(kernels.KERNELS["predict_backward"]) + 1)),
        *((f"correct_backward_v{v}_with_active", lambda v=v: kernels.correct_backward(
            grad, streams, activated, Q, R, w, active, eps, scale, v, grad_active=grad_active), (2 * n + 4) * row)
          for v in range(1, len(kernels.KERNELS["correct_backward"]) + 1)),
        ("expand_epilogue", lambda: kernels.expand_epilogue(
            device, n, m, h, x0.data_ptr(), projected.data_ptr(), expanded.data_ptr(), floor),
         (1 + 2 * (n - 1) + n) * row),
        *((f"magnitude_match_backward_v{v}", lambda v=v: kernels.magnitude_match_backward(
            device, n, m, h, grad.data_ptr(), m * h, 1.0, x0.data_ptr(), projected.data_ptr(), (h, (n - 1) * h),
            grad_projected.data_ptr(), grad_base.data_ptr(), True, floor, v),
           (n + 1 + 2 * (n - 1) + (n - 1) + 2) * row) for v in range(1, len(kernels.KERNELS["magnitude_match_backward"]) + 1)),
    ]


def bench_kernels(reps, warmup, info):
    rows = []
    for tokens in KERNEL_TOKENS:
        for name, call, nbytes in _kernel_cases(tokens):
            ours = statistics.median(time_us(call, reps, warmup)[0])
            floor = statistics.median(time_us(copy_floor(nbytes, "cuda"), reps, warmup)[0])
            rows.append(dict(kernel=name, N=STREAMS, H=HIDDEN, tokens=tokens, compulsory_bytes=nbytes,
                             gpu_median_us=f"{ours:.1f}", copy_floor_us=f"{floor:.1f}",
                             vs_copy_floor=f"{ours / floor:.2f}", tbps=f"{nbytes / ours / 1e6:.2f}", **info))
            print(f"{name:>36} M={tokens}: {ours:.1f} us, copy floor {floor:.1f} us ({ours / floor:.2f}x)",
                  flush=True)
        torch.cuda.empty_cache()
    return rows


def run_tests(quick: bool, log: Path) -> int:
    command = [sys.executable, "-m", "pytest", "-v", "-rs", "tests/test_gemma3n_gpu.py",
               "tests/test_gemma3n_reference.py", "tests/test_gemma3n_torch.py", "tests/test_gemma3n_patch.py"]
    if quick:
        command += ["-x", "-k", "not 4099 and not training"]
    print("$", " ".join(command), flush=True)
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                            env={**os.environ, "ALTUP_REQUIRE_GPU": "1", "PYTHONPATH": str(REPO_ROOT)})
    log.write_text(result.stdout + result.stderr)
    print(result.stdout[-3000:], result.stderr[-2000:], sep="\n", flush=True)
    return result.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, repetitions and tests")
    parser.add_argument("--no-tests", action="store_true", help="skip the GPU tests")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="what to time (default: all)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the CSV (default: results/<gpu name>/gemma3n_training_step.csv)")
    parser.add_argument("--profile", metavar="KERNEL", default=None,
                        help="no timing: run this row kernel (a `kernel` of gemma3n_kernels.csv) twice at "
                             "--profile-tokens, for a profiler: ncu --clock-control none -k regex:<name> -s 1")
    parser.add_argument("--profile-tokens", type=int, default=KERNEL_TOKENS[-1])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile is not None:
        calls = {name: call for name, call, _ in _kernel_cases(args.profile_tokens)}
        if args.profile not in calls:
            parser.error(f"--profile: one of {', '.join(calls)}")
        for _ in range(2):  # the first compiles and warms up
            calls[args.profile]()
        torch.cuda.synchronize()
        return 0
    if args.out is None:
        args.out = results_dir(torch.cuda.get_device_name()) / "gemma3n_training_step.csv"
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    status = 0 if args.no_tests else run_tests(args.quick, args.out.with_name("gemma3n_gpu_tests.log"))
    reps, warmup = (5, 2) if args.quick else (20, 3)
    info = run_info()
    written = []
    if "kernels" in args.parts:
        written.append(args.out.with_name("gemma3n_kernels.csv"))
        write_csv(bench_kernels(reps, warmup, info), written[-1], KERNEL_COLUMNS)
    rows = []
    if "altup_step" in args.parts:
        rows += bench_altup_step(QUICK_SHAPES if args.quick else SHAPES, reps, warmup, info)
    if "model_step" in args.parts:
        rows += bench_model_step(reps, warmup, info)
    if rows:
        written.append(args.out)
        write_csv(rows, args.out, COLUMNS)
    tests = "not run (--no-tests)" if args.no_tests else "passed" if status == 0 else "FAILED (see the log)"
    print(f"wrote {', '.join(map(str, written)) or 'nothing'}; tests {tests}")
    return status


if __name__ == "__main__":
    sys.exit(main())
