"""Benchmark: measured single- vs multi-device speedup, an analytic communication model, and the report."""
