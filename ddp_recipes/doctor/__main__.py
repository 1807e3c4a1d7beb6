"""Entry point of ``python -m ddp_recipes.doctor`` and ``torchrun ... -m ddp_recipes.doctor`` (every torchrun
worker runs it). The ranks the doctor spawns itself start in ``ddp_recipes.doctor.ranks``, never here."""

from ddp_recipes.doctor.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
