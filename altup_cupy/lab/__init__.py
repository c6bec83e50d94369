"""Research tools beside the runtime core: benchmarks, figures, reports, notebook helpers (the core imports none of them)."""
