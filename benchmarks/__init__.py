"""Developer benchmarks, run from a clone (not installed with the pack): what the pack itself costs and does, the
figures the docs quote. ``python -m benchmarks account|overhead|stops`` and ``python -m benchmarks.memory``."""
