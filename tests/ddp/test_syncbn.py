"""CPUSyncBatchNorm in one process (== BatchNorm) and the convert / revert round trip."""

from __future__ import annotations

import torch
from torch import nn

from ddp_recipes.ddp.syncbn import (
    CPUSyncBatchNorm,
    SyncBatchNormPlugin,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
                         nn.BatchNorm1d(5, momentum=None))


def test_single_process_equals_batchnorm():
    torch.manual_seed(0)
    plain = _net()
    synced = convert_sync_batchnorm(_net())
    synced.load_state_dict(plain.state_dict())
    assert isinstance(synced[1], CPUSyncBatchNorm) and isinstance(synced[5], CPUSyncBatchNorm)
    x = torch.randn(8, 3, 8, 8)
    for _ in range(2):
        out_plain, out_sync = plain(x), synced(x)
        assert torch.allclose(out_plain, out_sync, atol=1e-6)
    out_plain.sum().backward()
    out_sync.sum().backward()
    for (name, a), b in zip(plain.named_parameters(), synced.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), name
    for key, value in plain.state_dict().items():
        assert torch.allclose(value.float(), synced.state_dict()[key].float(), atol=1e-6), key
    plain.eval()
    synced.eval()
    assert torch.allclose(plain(x), synced(x), atol=1e-6)


def test_revert_restores_the_original_classes_and_state():
    net = _net()
    converted = SyncBatchNormPlugin("cpu").apply(net)
    converted(torch.randn(4, 3, 8, 8))
    back = SyncBatchNormPlugin("cpu").revert(converted)
    assert type(back[1]) is nn.BatchNorm2d and type(back[5]) is nn.BatchNorm1d
    assert back[5].momentum is None and back[1].num_batches_tracked.item() == 1
    assert set(back.state_dict()) == set(_net().state_dict())


def test_cuda_plugin_chooses_torch_syncbatchnorm():
    converted = SyncBatchNormPlugin("cuda").apply(_net())
    assert isinstance(converted[1], nn.SyncBatchNorm)
    assert type(revert_sync_batchnorm(converted)[1]) is nn.BatchNorm2d


def test_no_collective_outside_training(monkeypatch):
    """With track_running_stats=False evaluation uses batch statistics, but this rank's own (as torch's
    SyncBatchNorm): evaluation shards differ in size per rank, so a collective there would hang or pair up
    mismatched batches. Training at world size 2 does reduce."""
    from ddp_recipes.ddp import syncbn

    calls = []
    monkeypatch.setattr(CPUSyncBatchNorm, "_world", lambda self: 2)
    monkeypatch.setattr(syncbn, "all_reduce_sum", lambda t, group=None: calls.append(t.shape) or t * 2)
    bn = CPUSyncBatchNorm(3, track_running_stats=False)
    x = torch.randn(5, 3, 4, 4)
    bn.eval()
    assert torch.allclose(bn(x), nn.BatchNorm2d(3, track_running_stats=False).eval()(x), atol=1e-6)
    assert calls == []
    bn.train()
    bn(x)
    assert len(calls) == 2  # count + sums, then the centred squares
