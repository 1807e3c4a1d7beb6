"""``python -m benchmarks.memory``: peak memory and step time per variant (``run``), each variant
measured in a fresh process (``worker``), the table (``report``)."""
