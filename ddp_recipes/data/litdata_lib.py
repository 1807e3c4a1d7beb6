"""litdata (Lightning's streaming-dataset library), imported on first use: the one place that imports it, that
names the ``stream`` extra when it is missing, and that lets it talk to an ``http://`` S3 endpoint.

litdata is an optional extra (``pip install 'ddp-recipes[stream]'``); the lent GPU machine has no registry and
no litdata, so nothing imports it at module level.
"""

from __future__ import annotations

import os
from types import ModuleType

from ddp_recipes.errors import ConfigError

STREAM_EXTRA = "pip install 'ddp-recipes[stream]'"


def import_litdata(needed_for: str = "converting to a streamable dataset") -> ModuleType:
    """The ``litdata`` module, ready for the configured endpoint; a one-line :class:`ConfigError` naming the
    extra when it is not installed."""
    try:
        import litdata
    except ImportError:
        raise ConfigError(f"{needed_for} needs litdata, which is not installed: {STREAM_EXTRA}") from None
    allow_http_endpoint()
    return litdata


def allow_http_endpoint() -> None:
    """Let litdata's obstore client reach a plain-http S3 endpoint (MinIO, moto, a cluster-local gateway).

    Why here, and by a private name: litdata hands obstore explicit client options, so obstore's own switch
    (``AWS_ALLOW_HTTP``) is never read, and obstore refuses ``http://`` ("builder error") for every chunk
    upload and most downloads. The option dict is module state inherited by forked workers; a spawned worker
    that imports litdata through :func:`import_litdata` sets it again. Only an ``http://`` AWS_ENDPOINT_URL
    turns it on: real S3 over https is untouched. pyproject caps litdata below 0.3 because of this name.
    """
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3") or ""
    if endpoint.startswith("http://"):
        from litdata.streaming import downloader

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
