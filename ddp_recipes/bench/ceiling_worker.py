"""One worker of :func:`ddp_recipes.bench.hostinfo.parallel_ceiling`, run as a script by its path.

A script, not a multiprocessing target: a spawned target would import the ``ddp_recipes`` package (and
with it torch and Lightning) plus the caller's ``__main__``, seconds per worker on a loaded box. This file
needs only numpy. Protocol on stdin/stdout, one line each: it prints ``ready`` after a warm-up, then for
every ``run`` line it gets, runs the loop for SECONDS and prints the matmuls per second; EOF ends it.

Usage: python ceiling_worker.py SIZE SECONDS
"""

import sys
import time

import numpy as np


def matmul_rate(a: np.ndarray, b: np.ndarray, seconds: float) -> float:
    """Matmuls per second of one thread over ``seconds`` (the caller sets one BLAS thread)."""
    count, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        a @ b
        count += 1
        now = time.perf_counter()
        if now >= deadline:
            return count / (now - start)


def main() -> None:
    size, seconds = int(sys.argv[1]), float(sys.argv[2])
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((size, size), np.float32), rng.standard_normal((size, size), np.float32)
    matmul_rate(a, b, 0.05)  # warm-up: BLAS kernel selection, page faults
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(repr(matmul_rate(a, b, seconds)), flush=True)


if __name__ == "__main__":
    main()
