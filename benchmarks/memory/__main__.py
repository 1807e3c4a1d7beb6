"""``python -m benchmarks.memory`` (:mod:`benchmarks.memory.run`)."""

from benchmarks.memory.run import main

if __name__ == "__main__":
    raise SystemExit(main())
