"""Microbenchmarks run with ``python -m microbench.<name>``; results go to docs/results/."""
