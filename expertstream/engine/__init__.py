"""The workload: a model's layers as plans of splits (runner, architectures, layer split, offload)."""
