"""The ResNet recipe with one rank that gives up on the store first, for tests/data/test_stream_outage.py:
``OUTAGE_FIRST_RANK=R python tests/scenarios/outage_first.py [flags...]``.

Rank R's storage layer makes 2 attempts, the other ranks' the default 8 (about 45 s of backoff): in an outage of
the whole store rank R fails first while the other ranks' loader workers are still retrying, as a rank whose
read started a little earlier does in a real outage.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FIRST = os.environ.get("OUTAGE_FIRST_RANK")
if FIRST is not None:  # before the pack is imported: the storage layer reads it once
    # Lightning starts the other ranks by running this script again, with LOCAL_RANK set (rank 0 has none yet).
    os.environ["DDP_RECIPES_STORAGE_ATTEMPTS"] = "2" if os.environ.get("LOCAL_RANK", "0") == FIRST else "8"

from recipes.resnet import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
