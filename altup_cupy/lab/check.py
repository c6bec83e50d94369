"""Correctness of the kernels on this GPU, by the two rules every test and benchmark uses.

1. The benchmark's matched-ratio rule (docs/SPEC.md section 3) against a float64 reference.
2. The accuracy oracle: the output's relative L2 error against float64 is at most twice that of
   the plain PyTorch fp32 implementation on the same inputs (with a 1e-6 floor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .bench import OpBench
from .workloads import Workload, tolerance_report

ORACLE_FACTOR = 2.0
ORACLE_FLOOR = 1e-6


def oracle_bound(oracle_rel_l2: float) -> float:
    """The largest relative L2 error the oracle allows, given plain PyTorch fp32's on the same inputs."""
    return max(ORACLE_FACTOR * oracle_rel_l2, ORACLE_FLOOR)


@dataclass(frozen=True)
class OutputCheck:
    impl: str
    output: str
    match_ratio: float
    rel_l2: float
    oracle_rel_l2: float
    finite: bool
    rule_passed: bool

    @property
    def oracle_passed(self) -> bool:
        return self.rel_l2 <= oracle_bound(self.oracle_rel_l2)

    @property
    def passed(self) -> bool:
        return self.rule_passed and self.oracle_passed


def verify(bench: OpBench, w: Workload, seed: int, impl_names: Sequence[str],
           inputs: dict | None = None) -> list[OutputCheck]:
    """Run each named implementation once on fresh inputs; check every output by both rules."""
    import torch

    impls = {impl.name: impl for impl in bench.impls(w)}
    inputs = bench.make_inputs(w, seed) if inputs is None else inputs
    reference = bench.reference(inputs)
    oracle = impls[bench.oracle_impl].prepare(inputs)()
    oracle_errors = [tolerance_report(o, r, w.atol, w.rtol).rel_l2 for o, r in zip(oracle, reference, strict=True)]
    checks = []
    for name in impl_names:
        outputs = impls[name].prepare(inputs)()
        torch.cuda.synchronize()
        for out_name, out, ref, oracle_err in zip(bench.output_names, outputs, reference, oracle_errors, strict=True):
            report = tolerance_report(out, ref, w.atol, w.rtol)
            checks.append(OutputCheck(name, out_name, report.match_ratio, report.rel_l2, oracle_err,
                                      report.finite, report.passed))
    return checks
