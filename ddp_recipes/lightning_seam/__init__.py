"""The pack's one seam to Lightning's private state (underscore names of its Trainer, loops, connectors, strategy
and launcher; swapped connector classes; switched-off hooks; private functions): :mod:`.reach` the touches,
:mod:`.connectors` the swapped connectors, :mod:`.check` their assumptions, checked when a Trainer is built.
Nothing outside this folder names a private Lightning name (tests/cross_cutting/test_lightning_seam.py).
"""
