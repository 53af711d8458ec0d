"""Deprecated: the workload moved to ``expertstream.engine``, its benchmarks to ``expertstream.bench`` and
its commands to ``expertstream.cli``; these aliases go away in 0.3."""
