"""Step times are device time (issue #20.5): the clock's choice on CPU, CUDA events on a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from ddp_recipes.train.callbacks import ThroughputMeter
from ddp_recipes.train.perf import StepClock

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("device", "kind"), [("cpu", "host"), ("cuda", "cuda-events"), ("cuda:1", "cuda-events"),
                                              ("meta", "host")])
def test_the_clock_is_chosen_by_device(device, kind):
    assert StepClock(torch.device(device)).kind == kind  # choosing creates no event: works without CUDA


def test_the_host_clock_times_host_work():
    clock = StepClock("cpu")
    start = clock.mark()
    time.sleep(0.02)
    assert clock.seconds(start, clock.mark()) >= 0.02


@pytest.mark.gpu
@cuda
def test_cuda_events_time_the_device_and_never_synchronize():
    clock = StepClock(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        host = time.perf_counter()
        start = clock.mark()
        for _ in range(20):
            x = x @ x
            x = x / x.norm()
        end = clock.mark()
        queued = time.perf_counter() - host
        pending = clock.seconds(start, end)  # may be None: the device is still working, and we did not wait
    finally:
        torch.cuda.set_sync_debug_mode("default")
    device = clock.seconds(start, end, wait=True)
    assert pending is None or pending == pytest.approx(device)
    # 20 4096^3 matmuls take milliseconds of device time; queueing them takes far less on the host.
    assert device > 0 and device > queued / 10


@pytest.mark.gpu
@cuda
def test_a_recipe_fit_on_cuda_reports_device_time_without_syncs(tmp_path):
    import warnings

    import lightning as L
    from torch.utils.data import DataLoader

    from ddp_recipes.data.samplers import TensorBatchDataset, keep_batch
    from ddp_recipes.modules.mnist import MNISTClassifier
    from ddp_recipes.train.trainer import build_trainer

    class SyncWatch(L.Callback):
        """Sync debug mode "warn" over steps 5..15 (steady state); records what it warned about."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 5:
                torch.cuda.set_sync_debug_mode("warn")
            elif batch_idx == 15:
                torch.cuda.set_sync_debug_mode("default")

    meter = ThroughputMeter()
    data = TensorBatchDataset(torch.randn(4096, 1, 28, 28), torch.randint(0, 10, (4096,)))
    trainer = build_trainer(accelerator="cuda", devices=1, max_steps=30, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                            callbacks=[meter, SyncWatch()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(MNISTClassifier(), DataLoader(data, batch_size=64, collate_fn=keep_batch))
    assert meter.clock is not None and meter.clock.kind == "cuda-events"
    assert meter.samples_per_sec and meter.samples_per_sec > 0 and meter.first_step_s is not None
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    # Lightning's own logging reads the loss every log_every_n_steps (50): none of those fall in 5..15.
    assert not syncs, syncs[:3]
