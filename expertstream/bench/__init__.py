"""Measurement of the engine: rows and baselines, tune and its probes, prediction, reports, provenance."""
