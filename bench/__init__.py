"""GPU benchmarks; each writes JSON + a plot. See docs/benchmarks.md."""
