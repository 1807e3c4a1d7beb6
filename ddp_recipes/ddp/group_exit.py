"""The default process group at interpreter exit: destroyed after a run that succeeded, left alone after a
failure (on every backend; Lightning handles NCCL only, and tears the group down even after a failure)."""

from __future__ import annotations

import atexit

from ddp_recipes.lightning_seam.reach import destroy_dist_connection, keep_dist_connection_at_exit

_group_at_exit = {"registered": False, "destroy": True}


def destroy_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit, on every backend (once per process).

    Lightning registers this for NCCL only. A gloo group left to interpreter finalization can abort a run
    that succeeded: gloo's threads still hold work whose tensors need the GIL once Python is tearing down,
    and the rank dies with "terminate called without an active exception" (SIGABRT), which torchrun
    reports as a failed job (pytorch/pytorch#179291). ``atexit`` runs while the interpreter is whole; the
    handler is a no-op when the group is gone already (a user's own ``destroy_process_group``). Called at
    each run's set-up: a run that succeeds after a failed one in the same process destroys it again.
    """
    _group_at_exit["destroy"] = True
    if not _group_at_exit["registered"]:
        _group_at_exit["registered"] = True
        atexit.register(_destroy_group_unless_failed)


def keep_group_at_exit() -> None:
    """After a failure, leave the group to the process's end: a failing rank may still have a collective in
    flight that waits for peers stuck in another one, and a teardown would wait with it (torchtitan#1342).
    Lightning's own exit handler for NCCL groups is taken off too (it would tear the group down regardless)."""
    _group_at_exit["destroy"] = False
    keep_dist_connection_at_exit()


def _destroy_group_unless_failed() -> None:
    if _group_at_exit["destroy"]:
        destroy_dist_connection()
