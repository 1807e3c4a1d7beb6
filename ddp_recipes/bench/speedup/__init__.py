"""The default command, ``python -m ddp_recipes.bench``: single- vs multi-device speedup (``run``) and its
report, table and plot (``report``)."""
