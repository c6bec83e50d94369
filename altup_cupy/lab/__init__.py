"""The research tools beside the runtime: workloads, benchmarks and their harness, the correctness
rules of `python -m altup_cupy check`, the offline compile report, figures, README tables, notebook
helpers, the whole-model Gemma 3n benchmark. The runtime (the rest of `altup_cupy`) imports none
of them (tests/test_package_layout.py); `python -m altup_cupy` drives them."""
