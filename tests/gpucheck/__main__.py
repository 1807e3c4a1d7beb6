"""``python -m tests.gpucheck``: see :mod:`tests.gpucheck.check`."""

from tests.gpucheck.check import main

raise SystemExit(main())
