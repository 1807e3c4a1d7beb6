"""ResumablePowerSGD: per-parameter state across DDP bucket layouts, and a resumed run that compresses
exactly as the uninterrupted one (torch's hook on a one-rank gloo group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_recipes.ddp.commhooks import ResumablePowerSGD, _numel

A, B, C = ("a", (8, 8)), ("b", (8, 8)), ("c", (8,))  # two compressible matrices and a bias


def take(psgd: ResumablePowerSGD, index: int, layout):
    """What the hook does before torch's PowerSGD runs on a bucket with this layout."""
    return psgd._prepare(index, layout, torch.zeros(1))


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


# ---- the hook itself, on real gradients ------------------------------------------------------------------

class Bucket:
    """A DDP bucket as torch's hook reads it: a flat buffer, per-parameter views of it, index, is_last."""

    def __init__(self, layout, grads: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]) -> None:
        self.flat = torch.cat([grads[name].reshape(-1) for name, _ in layout])
        self.views, offset = {}, 0
        for name, shape in layout:
            self.views[name] = self.flat[offset:offset + _numel(shape)].view(shape)
            offset += _numel(shape)
        self._params = [params[name] for name, _ in layout]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def buffer(self) -> torch.Tensor:
        return self.flat

    def gradients(self) -> list[torch.Tensor]:
        return list(self.views.values())

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params


# Groups these tests made, kept to the end of the process. PowerSGD's future callbacks hold the group, and
# gloo runs them on its own threads: were one of those to drop the last reference, the group's destructor
# would join that very thread and abort the whole pytest run ('Resource deadlock avoided', seen in CI).
_KEPT_GROUPS: list = []


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    _KEPT_GROUPS.append(dist.group.WORLD)
    dist.destroy_process_group()


# The MNIST MLP's tensors. DDP's rebuilt layout (the one a run saves) puts the weights 8 bytes off a
# 16-byte boundary; its initial layout (a new process's first step) puts them on one.
MLP = {"1.weight": (128, 784), "1.bias": (128,), "3.weight": (10, 128), "3.bias": (10,)}
REBUILT = tuple((n, MLP[n]) for n in ("3.bias", "3.weight", "1.bias", "1.weight"))
INITIAL = tuple((n, MLP[n]) for n in ("1.weight", "1.bias", "3.weight", "3.bias"))


@pytest.mark.parametrize("saved_at", [4, 6], ids=["at-start-iter", "mid-compression"])
def test_resumed_first_step_compresses_like_the_uninterrupted_run(saved_at, one_rank_group):
    """Steps 0..8 (PowerSGD from 4); a copy saved after ``saved_at`` steps continues in a new state whose
    first bucket arrives in the initial layout. Every step's result must equal the uninterrupted one's bit
    for bit: at the start iteration torch draws Q in the packing order of the layout it sees, and MKL's
    matrix-vector product depends on a matrix's offset modulo 16 bytes."""
    gen = torch.Generator().manual_seed(0)
    steps = [{n: torch.randn(shape, generator=gen) for n, shape in MLP.items()} for _ in range(9)]
    params = {n: torch.nn.Parameter(torch.zeros(shape)) for n, shape in MLP.items()}

    def new() -> ResumablePowerSGD:
        psgd = ResumablePowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=4)
        psgd._names = {id(p): n for n, p in params.items()}  # what set_module gives for the MLP
        return psgd

    def step(psgd: ResumablePowerSGD, layout, grads) -> dict[str, torch.Tensor]:
        bucket = Bucket(layout, grads, params)
        out = psgd.hook(psgd.state, bucket).wait()
        assert out.data_ptr() == bucket.flat.data_ptr()  # DDP reads the result from its own bucket
        return {name: view.clone() for name, view in bucket.views.items()}

    straight, results = new(), []
    for i, grads in enumerate(steps):
        results.append(step(straight, INITIAL if i == 0 else REBUILT, grads))
        if i + 1 == saved_at:
            saved = straight.state_dict()
    assert saved["iter"] == saved_at
    resumed = new()
    resumed.load_state_dict(saved, torch.device("cpu"))
    for i in range(saved_at, len(steps)):
        got = step(resumed, INITIAL if i == saved_at else REBUILT, steps[i])
        different = [n for n in MLP if not torch.equal(got[n], results[i][n])]
        assert not different, f"step {i}: {different} differ"
    assert resumed.layouts[0] == REBUILT
