"""``python -m ddp_recipes.bench.memory`` (:mod:`ddp_recipes.bench.memory.run`)."""

from ddp_recipes.bench.memory.run import main

if __name__ == "__main__":
    raise SystemExit(main())
