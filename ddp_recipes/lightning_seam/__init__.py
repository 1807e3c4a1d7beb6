"""The pack's one seam to Lightning's private state: every read or write of an underscore name of Lightning's
Trainer, loops, connectors, strategy or launcher, every swapped connector class, every switched-off hook and
every private Lightning function lives here, each with what it works around, its upstream reference and the
Lightning versions it was checked on.

* :mod:`~ddp_recipes.lightning_seam.reach`: the touches, as small named functions;
* :mod:`~ddp_recipes.lightning_seam.connectors`: the connectors the pack swaps in;
* :mod:`~ddp_recipes.lightning_seam.check`: the table of the seam's assumptions, checked when the pack builds a
  Trainer (one line and exit 2 when a Lightning release moved one).

Nothing outside this folder names a private Lightning name (tests/cross_cutting/test_lightning_seam.py).
"""
