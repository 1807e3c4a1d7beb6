"""A run's folder and what continues in it: which folder (``output_dir.py``: ``--output-dir`` or ``version_N``),
whose it is (``ownership.py``: run ids, ``run.json``, the refusals, the newest checkpoint of the run) and which
checkpoint every rank loads (``resume.py``: checked before the launch, decided on rank 0 in the ranks)."""
