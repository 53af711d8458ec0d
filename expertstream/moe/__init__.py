"""Prefill and decode of MoE models with host-resident experts: runner, measurement, commands."""
