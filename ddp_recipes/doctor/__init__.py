"""`python -m ddp_recipes.doctor`: the "run a minimal init script first" tip as a command.

Pre-flight checks on the launcher (flags, MASTER_ADDR/PORT, NCCL/gloo variables, versions), then on every
rank: rendezvous, an exact all-reduce and a broadcast, and an all-reduce latency/bandwidth sweep reported
like nccl-tests. Ends with ``PASS`` (exit 0) or ``FAIL: <likely cause> -- fix: <fix>`` (exit 1); bad flags
exit 2. Every wait is bounded by --timeout-s, so it never hangs.

    python -m ddp_recipes.doctor                                  # all local GPUs, else 2 CPU processes
    python -m ddp_recipes.doctor --accelerator cpu --max-bytes 1M --json doctor.json
    python -m ddp_recipes.doctor --num-nodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
    torchrun --nproc-per-node 4 -m ddp_recipes.doctor             # torchrun's processes are the ranks
"""
