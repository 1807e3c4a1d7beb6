"""A run's folder and what continues in it: which folder (``output_dir.py``: ``--output-dir`` or
``version_N``), whose it is (``ownership.py``: run ids, ``run.json``, the refusals), which checkpoint continues
(``resume_choice.py``: ``--resume auto|PATH``, ``ckpt_path="last"``) and how every rank agrees on it
(``rank0_decision.py``: decided on rank 0, checked on every rank)."""
