"""Applications built on the planner, simulator and runtime: the `slimpack` command (cli.py,
cli_options.py), the demo (demo.py), the CPU profiler (profiler.py), fidelity checks
(fidelity.py), side-by-side comparisons (comparison.py) and `slimpack selftest` (selftest/)."""
