"""Transitional: ``bench/loader.py`` still imports :func:`~ddp_recipes.bench.cli.rewrite_doc` from here, its home
before ``bench account`` left the package for the clone's ``benchmarks/``."""

from ddp_recipes.bench import cli

rewrite_doc = cli.rewrite_doc
