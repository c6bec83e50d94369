"""Writes notebooks/0[123]_*.ipynb from the cell sources below, outputs cleared.

    /work/venv/bin/python scripts/build_notebooks.py

Edit the cells here (or edit the notebooks in Jupyter and stop using this script); the committed
notebooks carry their outputs from a GPU run (scripts/execute_notebooks.sh).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

SETUP = r'''
import sys
from pathlib import Path

ROOT = Path.cwd().resolve()
while not (ROOT / "altup_cupy").is_dir() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
sys.path.insert(0, str(ROOT))

import math, tempfile
import torch
from IPython.display import Image, Markdown, display

from altup_cupy import figures, notebook_support as nbs, report
from altup_cupy.workloads import workloads, tolerance_report

MODE = nbs.mode()   # "gpu": measure live; "cpu": replay results/h200/*.csv
FIG_DIR = Path(tempfile.mkdtemp(prefix="altup_nb_"))
'''.strip()

M = new_markdown_cell
C = lambda s: new_code_cell(s.strip())  # noqa: E731


def nb01():
    cells = [
        M(r"""# 01 · The AltUp collapse forward

Gemma 3n's AltUp block carries $N$ parallel copies ("streams") of the hidden state. At the end of the
decoder the streams are merged back into one: streams $1..N-1$ are projected by learned $H\times H$
matrices, rescaled to the RMS magnitude of stream 0, and averaged. This notebook derives the cost
of that merge, shows why the projections must stay in fp32 (the *precision trap*), walks through
kernel v1 next to its source, and compares it with every baseline.

The first cell decides the mode: on a machine where CuPy sees a GPU the notebook measures live;
elsewhere it replays the measurements recorded in `results/h200/`."""),
        C(SETUP),
        M(r"""## 1. The math (SPEC.md §1)

Inputs: `hidden_states` $x \in \text{bf16}^{N\times B\times S\times H}$, weights $W_k\in\text{bf16}^{H\times H}$ for
$k=1..N-1$ (`nn.Linear` layout, $y = xW^\top$), $\varepsilon$ = 1e-5. For every token row $t$ (all math in fp32):

$$s_0 = x_{0,t},\qquad \tau = \sqrt{\tfrac1H\textstyle\sum_d s_{0,d}^2}\quad(\text{no }\varepsilon)$$
$$y_k = x_{k,t}\,W_k^\top\ \ (\text{fp32 accumulate, not rounded}),\qquad \mu_k = \sqrt{\max\big(\tfrac1H\textstyle\sum_d y_{k,d}^2,\ \varepsilon\big)}$$
$$\text{out}_t = \frac1N\Big(s_0 + \sum_{k=1}^{N-1} y_k\,\frac{\tau}{\mu_k}\Big)\ \to \text{bf16}$$

Each projection is rescaled to the magnitude of stream 0, so the output is a magnitude-preserving
average. Below: the float64 reference of the package against the formula written out by hand, on a
small random example."""),
        C(r'''
from altup_cupy.reference import collapse_reference

g = torch.Generator().manual_seed(0)
N, B, S, H = 3, 2, 5, 64
hs = torch.randn(N, B, S, H, generator=g).bfloat16()
ws = torch.randn(N - 1, H, H, generator=g).bfloat16()
x = hs.double()
tau = x[0].pow(2).mean(-1, keepdim=True).sqrt()
by_hand = x[0].clone()
for k in range(1, N):
    y = x[k] @ ws[k - 1].double().T
    by_hand += y * tau / y.pow(2).mean(-1, keepdim=True).clamp_min(1e-5).sqrt()
by_hand /= N
ref = collapse_reference(hs, ws, 1e-5)
err = (ref - by_hand).abs().max().item()
print(f"max |reference - formula| = {err:.2e}")
assert err < 1e-12
'''),
        M(r"""## 2. The precision trap, with numbers

A bf16 model computes `x @ W.T` with a bf16 output: cuBLAS accumulates in fp32 but rounds $y_k$ to
bf16 (8 bits of mantissa, relative error up to $2^{-9}$) before the epilogue sees it. The benchmark's
rule (SPEC.md §3) asks, per element, $|\text{out}-\text{ref}| \le \text{atol} + \text{rtol}\,|\text{ref}|$ with
atol = 1e-5, rtol = 0.05, for at least 99% of the elements.

Why should a 0.4% rounding error break a 5% tolerance? Because the output is a *sum* of $N$ terms
of similar magnitude and random sign: wherever they nearly cancel, $|\text{ref}|$ is tiny and the
tolerance $0.05|\text{ref}|$ shrinks with it, while the rounding error of each term does not. The
fraction of elements near cancellation is what decides the verdict.

Below, at the benchmark's $H = 3072$, $N = 3$ and a reduced $M = 64$ tokens (the ratio does not
depend on $M$), on the CPU: both paths share the same fp32 epilogue; only the projection's output
dtype differs."""),
        C(r'''
g = torch.Generator().manual_seed(0)
N, M_TRAP, H = 3, 64, 3072
hs = torch.randn(N, 1, M_TRAP, H, generator=g).bfloat16()
ws = torch.randn(N - 1, H, H, generator=g).bfloat16()
ref = collapse_reference(hs, ws, 1e-5)          # float64

def epilogue(ys):
    """The fp32 epilogue of SPEC.md §1 on given projections y_k (fp32 tensors)."""
    s0 = hs[0].float()
    tau = s0.square().mean(-1, keepdim=True).sqrt()
    total = s0.clone()
    for y in ys:
        total += y * (tau / y.square().mean(-1, keepdim=True).clamp_min(1e-5).sqrt())
    return (total / N).bfloat16()

y_fp32 = [hs[k].float() @ ws[k - 1].float().T for k in range(1, N)]      # gemmEx with an fp32 C
y_bf16 = [(hs[k] @ ws[k - 1].T).float() for k in range(1, N)]            # a plain bf16 GEMM
results = {}
for name, ys in (("fp32 projections", y_fp32), ("bf16 projections", y_bf16)):
    rep = tolerance_report(epilogue(ys), ref, atol=1e-5, rtol=0.05)
    results[name] = rep
    print(f"{name:17s}: {100 * rep.match_ratio:7.3f}% of elements within tolerance, "
          f"rel. L2 error {rep.rel_l2:.2e} -> {'PASS' if rep.passed else 'FAIL'} (99% required)")
assert results["fp32 projections"].passed and not results["bf16 projections"].passed
'''),
        M(r"""The relative L2 errors differ by only ~30%, yet one path passes and the other fails: the verdict
is decided in the tail, by elements whose reference is near zero. The histogram makes that visible:
the failing elements of the bf16 path concentrate at small $|\text{ref}|$."""),
        C(r'''
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

out16 = epilogue(y_bf16).double()
r = ref.double()
fails = (out16 - r).abs() > 1e-5 + 0.05 * r.abs()
bins = torch.logspace(-4, 1, 26).double()
all_counts = torch.histogram(r.abs().flatten(), bins).hist
fail_counts = torch.histogram(r.abs()[fails].flatten(), bins).hist
fig, ax = plt.subplots(figsize=(8, 4))
centers = (bins[1:] * bins[:-1]).sqrt()
ax.semilogx(centers, 100 * fail_counts / all_counts.clamp_min(1), marker="o")
ax.set_xlabel("|reference| of the element")
ax.set_ylabel("% of elements failing (bf16 projections)")
ax.set_title(f"Precision trap: H={H}, N={N}, M={M_TRAP}; failures live where the output cancels")
fig.tight_layout(); fig.savefig(FIG_DIR / "trap.png", dpi=100, metadata={"Software": None}); plt.close(fig)
display(Image(FIG_DIR / "trap.png"))
print(f"elements failing: {fails.double().mean().item() * 100:.2f}%; median |ref| of failures "
      f"{r.abs()[fails].median().item():.3f} vs all elements {r.abs().median().item():.3f}")
'''),
        M(r"""So the projections must reach the epilogue in fp32: `cublasGemmEx` / `gemmStridedBatchedEx` with bf16
$A$, $B$ and an fp32 $C$ (or a fused GEMM whose epilogue never stores $y_k$). That costs fp32 traffic
for $y_k$ (4 bytes per element written and read back) in a design with a separate epilogue, which is
what kernel v1 does.

## 3. FLOPs, compulsory bytes and the speed of light per workload

$$\text{FLOP} = 2(N-1)\,M H^2,\qquad \text{bytes} = \underbrace{(N+1)\,M H\cdot 2}_{\text{streams in, output out}} + \underbrace{(N-1)\,H^2\cdot 2}_{\text{weights}}$$
$$T_\text{SOL} = \max\Big(\frac{\text{FLOP}}{989.4\ \text{TFLOP/s}},\ \frac{\text{bytes}}{4.8\ \text{TB/s}}\Big)$$

The arithmetic intensity tends to $(N-1)H/(N+1) = 1536$ FLOP/byte as $M$ grows; the H200's ridge point is
$989.4/4.8 \approx 206$ FLOP/byte, so the collapse is compute-bound from about $M \approx 300$ tokens on and
weight-bandwidth-bound below."""),
        C(r'''
PEAK, BW = 989.4e12, 4.8e12
def cost(w):
    flop = 2 * (w.streams - 1) * w.tokens * w.hidden ** 2
    byts = 2 * ((w.streams + 1) * w.tokens * w.hidden + (w.streams - 1) * w.hidden ** 2)
    return flop, byts
lines = ["| B×S | M | GFLOP | MB | FLOP/B | T_SOL µs | bound |", "|---|---:|---:|---:|---:|---:|---|"]
sols = []
for w in sorted(workloads("collapse"), key=lambda w: w.tokens):
    flop, byts = cost(w)
    t_c, t_m = flop / PEAK, byts / BW
    sols.append(1e6 * max(t_c, t_m))
    lines.append(f"| {w.batch_size}×{w.seq_len} | {w.tokens} | {flop / 1e9:.1f} | {byts / 1e6:.1f} | "
                 f"{flop / byts:.0f} | {1e6 * max(t_c, t_m):.1f} | {'compute' if t_c > t_m else 'memory'} |")
display(Markdown("\n".join(lines)))
print(f"mean T_SOL over the 16 workloads: {sum(sols) / len(sols):.1f} µs (SPEC.md: 192 µs)")
assert abs(sum(sols) / len(sols) - 192.4) < 0.5
'''),
        M(r"""## 4. Kernel v1: cuBLAS fp32-out GEMMs + one fused epilogue

v1 splits the op where the math splits:

1. **Projections** (all of the FLOPs): one `cublasGemmStridedBatchedEx` over the $N-1$ streams when the
   weights are stacked (one `gemmEx` per weight otherwise), bf16 inputs, fp32 output, fp32 compute, into a
   workspace bounded to 1 GiB (rows processed in blocks).
2. **Epilogue** (all of the reductions): one thread block per row. Each thread loads its 16-byte slices of
   $s_0$ and of every $y_k$ *once*, keeps them in registers, accumulates $\sum s_0^2$ and $\sum y_k^2$ in one
   pass, and a single block reduction yields all $N$ sums of squares. The scales $\tau/\mu_k$ and the $1/N$
   fold into one multiplier per stream, and the row is written as bf16 with 16-byte stores.

The epilogue's traffic is $M H\,(2 + 4(N-1) + 2)$ bytes, i.e. the fp32 round trip of the projections is the
price of the precision trap: what v1 cannot beat is the best fp32-out GEMM time plus that streaming floor
(`v1_floor_us` in `spec_baselines.json`: 318 µs mean vs a 192 µs speed of light).

The host side, as it stands in `altup_cupy/collapse.py`:"""),
        C(r'''
import importlib, inspect
collapse_module = importlib.import_module("altup_cupy.collapse")   # the module (the package re-exports the function)
print(inspect.getsource(collapse_module.collapse))
'''),
        M(r"""The epilogue kernel from `altup_cupy/collapse.cu` (statistics, one block reduction, the folded scale,
bf16 store), and the block reduction it calls from `common.cuh` (fixed order: bitwise reproducible):"""),
        C(r'''
print(nbs.file_header("collapse.cu"))
print()
print(nbs.kernel_source("collapse.cu", "collapse_epilogue_v1"))
print()
print(nbs.kernel_source("common.cuh", "block_sum"))
'''),
        M(r"""## 5. Measured results, against every baseline

In GPU mode the next cell checks (against float64) and times every implementation on five workloads
spanning the token range, with the harness of `altup_cupy.bench` (L2 flushed before every call, CUDA
events, median). In CPU mode it replays the full recorded run of all 16 workloads."""),
        C(r'''
if MODE == "gpu":
    chosen = sorted(workloads("collapse"), key=lambda w: w.tokens)
    chosen = [chosen[i] for i in (0, 4, 8, 12, 15)]
    rows = nbs.live_rows("collapse", chosen, reps=30, warmup=5)
    print("Live measurement, this machine:")
else:
    rows = nbs.recorded_rows("collapse", "benchmark")
if rows:
    print(figures.provenance(rows))
    display(Markdown(report.results_table(rows)))
'''),
        C(r'''
if rows:
    for fn, name in ((figures.plot_latency, "latency"), (figures.plot_pct_sol, "pct_sol"),
                     (figures.plot_speedup, "speedup")):
        with figures.style():
            path = fn("collapse", "benchmark", rows, FIG_DIR / f"{name}_collapse.png")
        if path:
            display(Image(path))
else:
    print("No measured rows to plot.")
'''),
        M(r"""The PyTorch and cuBLAS baselines recorded on the H200 for the spec (`results/h200/spec_baselines.json`;
these are fixed reference numbers, shown in both modes). `bf16_*` baselines fail the tolerance
(section 2); `v1_floor` is the best fp32-out GEMM plus the epilogue's streaming floor."""),
        C(r'''
import json
spec = json.loads((ROOT / "results/h200/spec_baselines.json").read_text())
print(spec["measured_on"])
cols = ["pub_us", "bf16_eager_us", "bf16_compiled_us", "cublas_fp32out_batched_us", "v1_floor_us", "sol_h200_us"]
lines = ["| B×S | M | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
for e in sorted(spec["collapse_us"], key=lambda e: e["M"]):
    lines.append(f"| {e['B']}×{e['S']} | {e['M']} | " + " | ".join(f"{e[c]:.1f}" for c in cols) + " |")
display(Markdown("\n".join(lines)))
'''),
    ]
    return cells


STEP = r'''
def check(name, derived, autograd_grad, package_stage=None, rtol=1e-9):
    """Assert the derived formula equals autograd's gradient (float64), and so does the package's stage."""
    scale = autograd_grad.abs().max().item() or 1.0
    err = (derived - autograd_grad).abs().max().item() / scale
    line = f"{name:>22s}: max |formula - autograd| / max|autograd| = {err:.1e}"
    assert err < rtol, f"{name}: the derived formula disagrees with autograd ({err:.2e})"
    if package_stage is not None:
        perr = (package_stage - autograd_grad).abs().max().item() / scale
        line += f";  package reference stage: {perr:.1e}"
        assert perr < rtol, f"{name}: altup_cupy.reference disagrees with autograd ({perr:.2e})"
    print(line + "  ok")
'''


def nb02():
    cells = [
        M(r"""# 02 · The predict-correct backward, derived step by step

AltUp's predict step mixes the $N$ streams with coefficients computed by a tiny router from the active
stream; the correct step pushes every stream toward the freshly computed activation. This notebook derives
the gradient of that step (SPEC.md §2), one intermediate at a time; **after every formula a cell checks it
numerically against `torch.autograd` in float64** (small shapes, CPU, an `assert` that fails if the
formula is wrong). Then it maps each step to its v1 kernel, explains how v2 fuses all of them into one
pass over the data, counts the bytes, and shows the measured results."""),
        C(SETUP),
        M(r"""## 1. The forward being differentiated

Per token $t$, with $h_j$ = `hidden_states[j, t]`, $x$ = `activated[t]`, $a$ = `altup_active_idx`, router
$R\in\mathbb R^{N\times H}$, norm weight $w\in\mathbb R^H$, $P\in\mathbb R^{N^2\times N}$, $Q\in\mathbb R^{N\times N}$:

$$\text{route}(v) = \tanh\!\big(R\,\hat v\big),\qquad \hat v = v\,r\,\frac{w}{H},\quad r = \Big(\tfrac1H\textstyle\sum_d v_d^2+\epsilon\Big)^{-1/2}$$
$$m_p = \text{route}(h_a),\quad C_{ij} = (P\,m_p)_{Ni+j},\quad \text{pred}_i = h_i + \textstyle\sum_j C_{ij}\,h_j$$
$$m_c = \text{route}(x),\quad k = Q\,m_c + 1,\quad \delta = x - \text{pred}_a,\quad \text{corrected}_i = \text{pred}_i + k_i\,\delta$$

The loss whose gradients we want is $L = \sum_t\sum_i \langle g_i, \text{corrected}_i\rangle$ with $g$ = `grad_corrected`.

Below, the forward is written out with every intermediate kept (`retain_grad`), so autograd reports
$\partial L/\partial(\cdot)$ for each of them. The two uses of `route()` get their own copy of the input
($h_a$ and $x$ also reach the output directly), so the router part of each gradient can be checked
on its own. Small shapes, a non-zero active index and a random norm weight, so that no term hides."""),
        C(r'''
from altup_cupy.reference import (predict_correct_autograd, predict_correct_backward_stages,
                                  predict_correct_forward)

torch.manual_seed(0)
N, B, S, H, A, EPS = 3, 2, 3, 64, 1, 1e-6
f64 = dict(dtype=torch.float64)
leaf = lambda *shape, scale=1.0: (torch.randn(*shape, **f64) * scale).requires_grad_(True)
h = leaf(N, B, S, H); x = leaf(B, S, H)
P = leaf(N * N, N, scale=N ** -0.5); Q = leaf(N, N, scale=N ** -0.5)
R = leaf(N, H, scale=H ** -0.5); w = (torch.randn(H, **f64) + 1).requires_grad_(True)
g = torch.randn(N, B, S, H, **f64)

T = {}   # every intermediate, gradients retained
def keep(name, t):
    t.retain_grad(); T[name] = t; return t

def route(v, tag):
    v = keep(f"v_{tag}", v.clone())                                   # the router's own copy of its input
    r = keep(f"r_{tag}", torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS))
    u = keep(f"u_{tag}", v * r)
    xn = keep(f"xn_{tag}", u * w / H)
    z = keep(f"z_{tag}", xn @ R.T)
    return keep(f"m_{tag}", torch.tanh(z))

m_p = route(h[A], "p")
Cm = keep("C", (m_p @ P.T).unflatten(-1, (N, N)))                   # [B, S, N(i), N(j)]
pred = keep("pred", h + torch.einsum("bsij,jbsh->ibsh", Cm, h))
m_c = route(x, "c")
k = keep("k", m_c @ Q.T + 1.0)                                       # [B, S, N]
delta = keep("delta", x - pred[A])
corrected = pred + k.permute(2, 0, 1).unsqueeze(-1) * delta
L = (g * corrected).sum()
L.backward()

# the package's forward must be this forward
assert torch.allclose(corrected, predict_correct_forward(h, x, P, Q, R, w, A, EPS), rtol=1e-12, atol=1e-12)
# the package's step-by-step reference (every intermediate of the backward, named as below)
st = predict_correct_backward_stages(g, h.detach(), x.detach(), P.detach(), Q.detach(), R.detach(),
                                     w.detach(), active_idx=A, eps=EPS)
grad = lambda name: T[name].grad
print(f"L = {L.item():.6f}; {len(T)} intermediates with gradients")
'''),
        C(STEP),
        M(r"""## 2. Gradient reaching $\delta$

$\delta$ enters every corrected stream with weight $k_i$:

$$g_\delta \;=\; \frac{\partial L}{\partial \delta} \;=\; \sum_i k_i\, g_i$$"""),
        C(r'''
gd = torch.einsum("bsi,ibsh->bsh", k.detach(), g)
check("g_delta", gd, grad("delta"), st.gd)
'''),
        M(r"""## 3. Correction coefficients

$\text{corrected}_i$ depends on $k_i$ through $k_i\delta$, and $k = Q m_c + 1$:

$$g_{k_i} = \langle g_i,\ \delta\rangle,\qquad g_{m_c} = Q^\top g_k,\qquad \frac{\partial L}{\partial Q} = \sum_t g_k\, m_c^\top$$"""),
        C(r'''
gk = torch.einsum("ibsh,bsh->bsi", g, delta.detach())
check("g_k", gk, grad("k"), st.gk)
gm_c = gk @ Q.detach()
check("g_m_c", gm_c, grad("m_c"), st.gm_c)
dQ = gk.reshape(-1, N).T @ m_c.detach().reshape(-1, N)
check("grad_correction_coefs", dQ, Q.grad, st.grad_correction_coefs)
'''),
        M(r"""## 4. Router backward (correct step)

Through $m = \tanh(z)$, $z = R\hat v$, $\hat v = u\,w/H$, $u = v\,r$:

$$g_z = g_m \odot (1 - m^2),\qquad g_{\hat v} = R^\top g_z,\qquad g_u = g_{\hat v}\odot \frac{w}{H}$$"""),
        C(r'''
gz_c = gm_c * (1 - m_c.detach() ** 2)
check("g_z_c", gz_c, grad("z_c"), st.gz_c)
gxn_c = gz_c @ R.detach()
check("g_xn_c", gxn_c, grad("xn_c"), st.gxn_c)
gu_c = gxn_c * w.detach() / H
check("g_u_c", gu_c, grad("u_c"), st.gu_c)
'''),
        M(r"""The RMS normalisation: $u = v\,r$ with $r = (\overline{v^2}+\epsilon)^{-1/2}$, so
$\partial r/\partial v = -r^3 v/H$ and

$$g_r = \langle g_u,\ v\rangle =: s,\qquad g_v = r\,g_u \;-\; \frac{r^3}{H}\, s\; v$$

one more reduction over $H$ per use of `route()`."""),
        C(r'''
s_c = (gu_c * x.detach()).sum(-1, keepdim=True)
check("g_r_c (= s_c)", s_c, grad("r_c"), st.s_c)
r_c = T["r_c"].detach()
gx_c = r_c * gu_c - r_c ** 3 * x.detach() * s_c / H
check("g_v_c (route input)", gx_c, grad("v_c"), st.gx_c)
'''),
        M(r"""The check can fail: drop the $r^3$ term (a plausible slip) and the assertion fires."""),
        C(r'''
try:
    check("wrong g_v_c", r_c * gu_c, grad("v_c"))
except AssertionError as error:
    print("caught, as it should be:", error)
else:
    raise RuntimeError("the check accepted a wrong formula")
'''),
        M(r"""## 5. Gradient reaching the predictions

$\text{pred}_i$ reaches the loss directly and, for $i=a$, through $\delta = x - \text{pred}_a$:

$$g_{\text{pred}_i} = g_i - [i = a]\; g_\delta$$"""),
        C(r'''
gpred = g.clone()
gpred[A] -= gd
check("g_pred", gpred, grad("pred"), st.gpred)
'''),
        M(r"""## 6. Prediction coefficients

$\text{pred}_i = h_i + \sum_j C_{ij} h_j$ and $C_{ij} = (P m_p)_{Ni+j}$:

$$g_{C_{ij}} = \langle g_{\text{pred}_i},\ h_j\rangle,\qquad g_{m_p} = P^\top \operatorname{vec}(g_C),\qquad
\frac{\partial L}{\partial P_{Ni+j,\,l}} = \sum_t g_{C_{ij}}\, m_{p,l}$$

$N^2$ more reductions over $H$ per token."""),
        C(r'''
dC = torch.einsum("ibsh,jbsh->bsij", gpred, h.detach())
check("g_C", dC, grad("C"), st.dC)
gm_p = dC.flatten(-2) @ P.detach()
check("g_m_p", gm_p, grad("m_p"), st.gm_p)
dP = dC.reshape(-1, N * N).T @ m_p.detach().reshape(-1, N)
check("grad_prediction_coefs", dP, P.grad, st.grad_prediction_coefs)
'''),
        M(r"""## 7. Router backward (predict step)

The same four formulas as in §4, on $v = h_a$:
$g_z = g_m\odot(1-m^2)$, $g_{\hat v} = R^\top g_z$, $g_u = g_{\hat v}\odot w/H$, $s = \langle g_u, h_a\rangle$,
$g_v = r g_u - r^3 s\, h_a/H$."""),
        C(r'''
gz_p = gm_p * (1 - m_p.detach() ** 2)
check("g_z_p", gz_p, grad("z_p"), st.gz_p)
gxn_p = gz_p @ R.detach()
check("g_xn_p", gxn_p, grad("xn_p"), st.gxn_p)
gu_p = gxn_p * w.detach() / H
check("g_u_p", gu_p, grad("u_p"), st.gu_p)
s_p = (gu_p * h.detach()[A]).sum(-1, keepdim=True)
check("g_r_p (= s_p)", s_p, grad("r_p"), st.s_p)
r_p = T["r_p"].detach()
gx_p = r_p * gu_p - r_p ** 3 * h.detach()[A] * s_p / H
check("g_v_p (route input)", gx_p, grad("v_p"), st.gx_p)
'''),
        M(r"""## 8. The activation gradients

$h_j$ reaches the loss as itself in $\text{pred}_j$, as a mixing input of every $\text{pred}_i$, and (for $j=a$)
through the router; $x$ through $\delta$ and through its router:

$$\frac{\partial L}{\partial h_j} = g_{\text{pred}_j} + \sum_i C_{ij}\, g_{\text{pred}_i} + [j=a]\; g_{v_p},
\qquad \frac{\partial L}{\partial x} = g_\delta + g_{v_c}$$"""),
        C(r'''
grad_h = gpred + torch.einsum("bsij,ibsh->jbsh", Cm.detach(), gpred)
grad_h[A] += gx_p
check("grad_hidden_states", grad_h, h.grad, st.grad_hidden_states)
grad_x = gd + gx_c
check("grad_activated", grad_x, x.grad, st.grad_activated)
'''),
        M(r"""## 9. Router and norm weights: the sum over both uses of `route()`

$z = R\hat v$ and $\hat v = u\odot w/H$ in both routes, so

$$\frac{\partial L}{\partial R} = \sum_t \big(g_{z_p}\,\hat v_p^\top + g_{z_c}\,\hat v_c^\top\big),\qquad
\frac{\partial L}{\partial w} = \frac1H\sum_t \big(g_{\hat v_p}\odot u_p + g_{\hat v_c}\odot u_c\big)$$

These four are reductions over all $M$ tokens (the weight gradients), unlike everything above, which is per token."""),
        C(r'''
tok = lambda t: t.detach().reshape(-1, t.shape[-1])
dR = tok(gz_p).T @ tok(T["xn_p"]) + tok(gz_c).T @ tok(T["xn_c"])
check("grad_router_weight", dR, R.grad, st.grad_router_weight)
dw = (tok(gxn_p) * tok(T["u_p"])).sum(0) / H + (tok(gxn_c) * tok(T["u_c"])).sum(0) / H
check("grad_norm_weight", dw, w.grad, st.grad_norm_weight)
'''),
        M(r"""And the package's two references agree on all six outputs, for every active index:"""),
        C(r'''
from altup_cupy.reference import predict_correct_backward_reference
for a in range(N):
    args = (g, h.detach(), x.detach(), P.detach(), Q.detach(), R.detach(), w.detach())
    ref = predict_correct_backward_reference(*args, active_idx=a, eps=EPS)
    auto = predict_correct_autograd(*args, active_idx=a, eps=EPS)
    for name, r_, a_ in zip(ref._fields, ref, auto):
        err = (r_ - a_).abs().max().item() / (a_.abs().max().item() or 1.0)
        assert err < 1e-9, (a, name, err)
    print(f"active_idx={a}: step-by-step reference == autograd on all {len(ref)} gradients")
'''),
        M(r"""## 10. From the derivation to kernels: v1, one kernel per step

Kernel v1 (`altup_cupy/predict_correct_bwd.cu`) follows the derivation literally: one small kernel per
stage, the per-token scalars ($r$, $m$, $C$, $k$, $g_k$, $g_z$, $g_C$) in a global scratch array, the two
router-backward rows $g_{v_c}$, $g_{v_p}$ in fp32 scratch rows.

| derivation step | quantity | v1 kernel |
|---|---|---|
| forward statistics | $r_p, r_c, m_p, m_c, C, k$ | `pc_v1_forward_stats` |
| §2–3 | $g_k = \langle g_i,\delta\rangle$ | `pc_v1_correction_grads` |
| §3–4 correct router | $g_{m_c}, g_{z_c}, g_{\hat v_c}, g_{u_c}, s_c, g_{v_c}$ | `pc_v1_correct_router_bwd` |
| §5–6 | $g_\delta$, $g_\text{pred}$, $g_C = \langle g_{\text{pred}_i}, h_j\rangle$ | `pc_v1_prediction_grads` |
| §7 predict router | $g_{m_p}, g_{z_p}, \dots, g_{v_p}$ | `pc_v1_predict_router_bwd` |
| §8 | `grad_hidden_states`, `grad_activated` | `pc_v1_elementwise` |
| §9 | $\partial L/\partial R$, $\partial L/\partial w$ (partials per token chunk) | `pc_v1_weight_grads` |
| §3, §6 | $\partial L/\partial P$, $\partial L/\partial Q$ (partials per token chunk) | `pc_v1_coef_grads` |
| all weight grads | fixed-order sum of the partials | `pc_reduce_partials` |

Every stage re-reads the token's rows it needs from HBM, so v1 moves several times the compulsory bytes.
The file's header and one stage:"""),
        C(r'''
print(nbs.file_header("predict_correct_bwd.cu"))
print()
print(nbs.kernel_source("predict_correct_bwd.cu", "pc_v1_correction_grads"))
'''),
        M(r"""## 11. v2: one fused pass

**The dependency chain per token.** Every reduction over $H$ needs the results of the previous one, but
the chain is only three rounds deep once the independent reductions are merged:

1. **Round 1** ($2 + 2N$ sums): $\sum h_a^2$ and $\sum x^2$ (the two RMS statistics) and the $2N$ router dot
   products $\langle R_n, v\odot w\rangle$ for both inputs. Because $r$ is a per-row scalar,
   $z = r\,(R(v\odot w))/H$, so the router products do not wait for $r$. Then $m_p, m_c, C, k$ per token.
2. **Round 2** ($N + N^2$ sums): with $C$ and $k$ known, $\delta$ and $g_\delta$ are element-wise, so
   $g_k = \langle g_i,\delta\rangle$ and $g_C = \langle g_i - [i=a]g_\delta,\ h_j\rangle$ reduce together.
   Then $g_{z_c}$, $g_{z_p}$ ($N$ numbers each).
3. **Round 3** (2 sums): $s_c = \langle g_{u_c}, x\rangle$ and $s_p = \langle g_{u_p}, h_a\rangle$, with
   $g_u = (R^\top g_z)\odot w/H$ element-wise.

Then both activation gradients are element-wise and are written once.

**What stays on chip.** One token's $2N+1$ input rows (N = 3, H = 2304: 7 × 4.6 KB = 32 KB) live in
registers as packed bf16 across the three rounds; a persistent grid walks the tokens and prefetches the next
token's rows while the current one is computed; $R$ and $w$ slices stay in registers, $P$ and $Q$ in shared
memory. HBM sees each input once and each output once: the compulsory 22·M·H bytes.

**Deterministic weight gradients.** $\partial L/\partial R$, $\partial L/\partial w$, $\partial L/\partial P$,
$\partial L/\partial Q$ are sums over tokens. Each persistent block accumulates its tokens' contributions in
registers in token order and writes one partial row at the end; `pc_reduce_partials` adds the partials in a
fixed block order. No atomics, so the fp32 weight gradients are bitwise reproducible run to run.

The three block reductions inside `pc_v2_fused`, then the deterministic reduction:"""),
        C(r'''
src = nbs.kernel_source("predict_correct_bwd.cu", "pc_v2_fused")
lines = src.splitlines()
hits = [i for i, l in enumerate(lines) if "block_sum<" in l]
print(f"pc_v2_fused: {len(lines)} lines; its block reductions:\n")
for i in hits:
    print("\n".join(f"{j:4d}  {lines[j]}" for j in range(max(0, i - 6), i + 1)))
    print("  ...")
print()
print(nbs.kernel_source("predict_correct_bwd.cu", "pc_reduce_partials"))
'''),
        M(r"""## 12. Bytes and the speed of light

Compulsory traffic per token (N = 3): read $g$ (N rows), $h$ (N rows), $x$ (1 row); write
`grad_hidden_states` (N rows) and `grad_activated` (1 row); bf16 everywhere:

$$\text{bytes} = (2N+1)\,MH\cdot 2 + (N+1)\,MH\cdot 2 = 22\,MH,\qquad T_\text{SOL} = \frac{22\,MH}{4.8\ \text{TB/s}}$$

(the weights and the fp32 weight gradients are $O(NH)$: negligible). Memory-bound at every size."""),
        C(r'''
lines = ["| B×S | M | MB moved | T_SOL µs |", "|---|---:|---:|---:|"]
sols = []
for wl in sorted(workloads("predict_correct_backward"), key=lambda w: w.tokens):
    byts = 22 * wl.tokens * wl.hidden
    sols.append(1e6 * byts / 4.8e12)
    lines.append(f"| {wl.batch_size}×{wl.seq_len} | {wl.tokens} | {byts / 1e6:.1f} | {sols[-1]:.1f} |")
display(Markdown("\n".join(lines)))
print(f"mean T_SOL: {sum(sols) / len(sols):.1f} µs (SPEC.md: 67 µs)")
assert abs(sum(sols) / len(sols) - 67.0) < 0.5
'''),
        M(r"""## 13. Measured results

GPU mode: every implementation (v2 = `altup_cupy`, v1 = `altup_cupy_v1`, the PyTorch baselines and a
copy floor) checked against float64 and timed on five workloads. CPU mode: the recorded run."""),
        C(r'''
OP = "predict_correct_backward"
if MODE == "gpu":
    chosen = sorted(workloads(OP), key=lambda w: w.tokens)
    chosen = [chosen[i] for i in (0, 4, 8, 12, 15)]
    rows = nbs.live_rows(OP, chosen, reps=30, warmup=5)
    print("Live measurement, this machine:")
else:
    rows = nbs.recorded_rows(OP, "benchmark")
if rows:
    print(figures.provenance(rows))
    display(Markdown(report.results_table(rows)))
    import matplotlib
    for fn, name in ((figures.plot_latency, "latency"), (figures.plot_pct_sol, "pct_sol"),
                     (figures.plot_speedup, "speedup")):
        with figures.style():
            path = fn(OP, "benchmark", rows, FIG_DIR / f"{name}_{OP}.png")
        if path:
            display(Image(path))
'''),
        C(r'''
import json
spec = json.loads((ROOT / "results/h200/spec_baselines.json").read_text())
print("Recorded for the spec:", spec["measured_on"])
cols = ["pub_us", "autograd_us", "compiled_us", "stream_7read_4write_us", "sol_h200_us"]
lines = ["| B×S | M | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
for e in sorted(spec["predict_correct_backward_us"], key=lambda e: e["M"]):
    lines.append(f"| {e['B']}×{e['S']} | {e['M']} | " + " | ".join(f"{e[c]:.1f}" for c in cols) + " |")
display(Markdown("\n".join(lines)))
'''),
    ]
    return cells


def nb03():
    cells = [
        M(r"""# 03 · Where every kernel stands on the H200

The roofline bounds a kernel's throughput by $\min(\text{peak FLOP/s},\ I\cdot\text{bandwidth})$ where
$I$ is its arithmetic intensity, FLOP per byte of *compulsory* HBM traffic (each input read once, each
output written once). Two pairs of ceilings: the datasheet (989.4 TFLOP/s dense bf16, 4.8 TB/s HBM3e)
and what was measured on the machine (`results/h200/spec_baselines.json`: cuBLAS bf16 8192³ at
772.1 TFLOP/s, a device copy at 4.22 TB/s). Every workload of both ops and every implementation is placed
on it; then latency against tokens and the % of speed of light per workload."""),
        C(SETUP),
        C(r'''
ceilings = figures.load_ceilings(ROOT / "results/h200")
ridge = ceilings["datasheet_tflops"] / ceilings["datasheet_tbps"]
print(f"datasheet: {ceilings['datasheet_tflops']} TFLOP/s, {ceilings['datasheet_tbps']} TB/s -> ridge {ridge:.0f} FLOP/B")
print(f"measured : {ceilings['measured_tflops']} TFLOP/s, {ceilings['measured_tbps']} TB/s -> ridge "
      f"{ceilings['measured_tflops'] / ceilings['measured_tbps']:.0f} FLOP/B   ({ceilings['measured_on']})")
for w in sorted(workloads("collapse"), key=lambda w: w.tokens)[::5]:
    flop = 2 * (w.streams - 1) * w.tokens * w.hidden ** 2
    byts = 2 * ((w.streams + 1) * w.tokens * w.hidden + (w.streams - 1) * w.hidden ** 2)
    print(f"collapse M={w.tokens:6d}: I = {flop / byts:6.0f} FLOP/B -> {'compute' if flop / byts > ridge else 'memory'}-bound")
print("predict_correct_backward: a few FLOP per byte at every M -> memory-bound")
'''),
        M(r"""## Data

GPU mode measures both ops live on a few workloads (all implementations); CPU mode replays the recorded
CSVs of both suites (the benchmark's 16 workloads per op, and Gemma 3n's own shapes)."""),
        C(r'''
results = {}
if MODE == "gpu":
    for op in ("collapse", "predict_correct_backward"):
        chosen = sorted(workloads(op), key=lambda w: w.tokens)
        results[(op, "benchmark")] = nbs.live_rows(op, [chosen[i] for i in (0, 7, 15)], reps=30, warmup=5)
    print("Live measurement, this machine.")
else:
    results = figures.load_results(ROOT / "results/h200")
for key, rows in sorted(results.items()):
    print(f"{key[0]:26s} {key[1]:10s} {len(rows):3d} rows   {figures.provenance(rows)}")
if not results:
    print("No measurements recorded yet: the roofline below shows the ceilings and where each "
          "collapse workload's speed of light lies.")
'''),
        M(r"""## The roofline"""),
        C(r'''
import matplotlib
matplotlib.use("Agg")
with figures.style():
    path = figures.plot_roofline(results, ceilings, FIG_DIR / "roofline.png") if results else None
if path is None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [10 ** (i / 50) for i in range(-50, 201)]
    ax.loglog(xs, [min(ceilings["datasheet_tflops"], ceilings["datasheet_tbps"] * x) for x in xs], "k-", label="datasheet")
    ax.loglog(xs, [min(ceilings["measured_tflops"], ceilings["measured_tbps"] * x) for x in xs], "k--", label="measured")
    for w in workloads("collapse"):
        flop = 2 * (w.streams - 1) * w.tokens * w.hidden ** 2
        byts = 2 * ((w.streams + 1) * w.tokens * w.hidden + (w.streams - 1) * w.hidden ** 2)
        ax.scatter(flop / byts, min(ceilings["datasheet_tflops"], ceilings["datasheet_tbps"] * flop / byts), color="C3")
    ax.set_xlabel("arithmetic intensity (FLOP per compulsory byte)"); ax.set_ylabel("TFLOP/s")
    ax.set_title("H200 ceilings and the collapse workloads' speed of light (no measurements yet)")
    ax.legend(); fig.tight_layout(); path = FIG_DIR / "roofline.png"
    fig.savefig(path, dpi=100, metadata={"Software": None}); plt.close(fig)
display(Image(path))
'''),
        M(r"""Reading it: the collapse's points sit right of the ridge (compute-bound) except at the smallest $M$,
where reading the two $H\times H$ weights dominates; the gap between our points and the measured
compute ceiling is the fp32 round trip of the projections plus the epilogue (notebook 01). The backward's
points sit far left, on the bandwidth slope; its distance below the slope is the fraction of the copy
bandwidth one fused pass reaches (notebook 02).

## Latency against tokens, and % of speed of light per workload"""),
        C(r'''
for (op, suite), rows in sorted(results.items()):
    with figures.style():
        for fn, name in ((figures.plot_latency, "latency"), (figures.plot_pct_sol, "pct_sol")):
            display(Image(fn(op, suite, rows, FIG_DIR / f"{name}_{op}_{suite}.png")))
    data = report.table_data(rows)
    print(f"{op} / {suite}: altup_cupy at {data['means']['pct_sol']:.1f}% of the speed of light on average, "
          f"{data['means']['speedup']:.2f}x (geomean) over the best passing PyTorch baseline")
'''),
        M(r"""## Every figure, regenerated from the recorded CSVs

`python -m altup_cupy figures` writes these to `figures/`; here into a temporary folder."""),
        C(r'''
written = figures.regenerate(ROOT / "results/h200", FIG_DIR / "all", log=lambda s: None)
print(f"{len(written)} figures:", ", ".join(p.name for p in written) or "none (no CSV recorded yet)")
'''),
    ]
    return cells


def write(name: str, cells) -> Path:
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    })
    for i, cell in enumerate(nb.cells):  # stable ids: no diff noise on rebuild
        cell["id"] = f"{name[:2]}-{i:02d}"
    nbformat.validate(nb)
    path = NOTEBOOKS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    for name, build in (("01_collapse_forward.ipynb", nb01), ("02_predict_correct_backward.ipynb", nb02),
                        ("03_roofline.ipynb", nb03)):
        print("wrote", write(name, build()))
