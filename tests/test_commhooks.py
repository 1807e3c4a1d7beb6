"""ResumablePowerSGD's bookkeeping: per-parameter state across DDP bucket layouts (no process group)."""

from __future__ import annotations

import torch

from ddp_recipes.ddp.commhooks import ResumablePowerSGD

A, B, C = ("a", (8, 8)), ("b", (8, 8)), ("c", (8,))  # two compressible matrices and a bias


def take(psgd: ResumablePowerSGD, index: int, layout) -> None:
    """What the hook does before torch's PowerSGD runs on a bucket with this layout."""
    if psgd.layouts.get(index) != layout and (psgd._pool or psgd.layouts):
        psgd._relayout(index, layout, torch.zeros(1))
    psgd.layouts[index] = layout
    psgd._owner.update((name, index) for name, _ in layout)


def test_state_follows_parameters_across_a_bucket_rebuild():
    psgd = ResumablePowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=2)
    s = psgd.state
    # The layout the run saved: one bucket (a, c, b); Q packs the two 8x8 matrices, a then b.
    take(psgd, 0, (A, C, B))
    s.error_dict[0] = torch.arange(64 + 8 + 64, dtype=torch.float32)
    s.q_memory_dict[0] = torch.arange(16, dtype=torch.float32) + 1000
    s.p_memory_dict[0] = torch.zeros(16)
    want_error = {"a": s.error_dict[0][:64].clone(), "c": s.error_dict[0][64:72].clone(),
                  "b": s.error_dict[0][72:].clone()}
    want_q = {"a": s.q_memory_dict[0][:8].clone(), "b": s.q_memory_dict[0][8:].clone()}

    saved = psgd.state_dict()
    assert set(saved["pieces"]) == {"a", "b", "c"} and "q" not in saved["pieces"]["c"]

    # A new process: DDP's initial layout puts a in bucket 1 alone and (b, c) in bucket 0.
    fresh = ResumablePowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=2)
    fresh.load_state_dict(saved, torch.device("cpu"))
    take(fresh, 1, (A,))
    take(fresh, 0, (B, C))
    f = fresh.state
    assert torch.equal(f.error_dict[1], want_error["a"]) and torch.equal(f.q_memory_dict[1], want_q["a"])
    assert torch.equal(f.error_dict[0], torch.cat([want_error["b"], want_error["c"]]))
    assert torch.equal(f.q_memory_dict[0], want_q["b"]) and f.p_memory_dict[0].numel() == 8  # n * r
    assert fresh._pool == {}

    # Then DDP rebuilds into the saved layout again: bucket 0 takes a (from bucket 1) and keeps b, c.
    f.error_dict[1] = f.error_dict[1] + 1  # a step happened: bucket 1 holds a's newer residual
    take(fresh, 0, (A, C, B))
    assert torch.equal(f.error_dict[0][:64], want_error["a"] + 1)  # the owner's copy, not a stale one
    pieces = fresh.state_dict()["pieces"]
    assert torch.equal(pieces["a"]["error"], want_error["a"] + 1) and torch.equal(pieces["b"]["q"], want_q["b"])


def test_a_bucket_with_nothing_to_compress_keeps_torch_from_drawing_a_new_q():
    psgd = ResumablePowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=2)
    take(psgd, 0, (C,))
    psgd.state.error_dict[0] = torch.ones(8)
    fresh = ResumablePowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=2)
    fresh.load_state_dict(psgd.state_dict(), torch.device("cpu"))
    take(fresh, 3, (C,))
    # torch's hook draws from its RandomState whenever the bucket has no P entry, even an empty one.
    assert fresh.state.p_memory_dict[3].numel() == 0 and fresh.state.q_memory_dict[3].numel() == 0
