"""RankWatch over whole fits in one process (one CPU device, the watch added by hand): it leaves nothing behind
when a fit raises or ends, a later fit starts afresh, and it reads the thread that runs the fit. The decisions
themselves: tests/ddp/test_hangs.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from ddp_recipes.ddp import hangs
from ddp_recipes.ddp.strategy import TunedDDPStrategy
from ddp_recipes.train.rank_watch import RankWatch
from tests.helpers import cpu_trainer


class _Fails(L.LightningModule):
    """A user's module whose third step raises: the fit ends by an exception, not at its limit."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("the user's bug")
        return self.layer(batch).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_fit_that_fails_leaves_no_watch_behind(tmp_path, capsys):
    """Lightning calls no callback's ``teardown`` when a fit raises: the watch must stop anyway, or it reports a
    'hang' of the run that already failed, into its folder, in a process that goes on (a notebook, a retry)."""
    watch = RankWatch(0.3, 60.0)
    trainer = cpu_trainer(max_steps=8, callbacks=[watch], default_root_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="the user's bug"):
        trainer.fit(_Fails())
    time.sleep(1.5)  # five bounds
    assert not any(t.name == "ddp-recipes-hang-watch" and t.is_alive() for t in threading.enumerate())
    assert not (tmp_path / hangs.REPORT_DIR).exists() and "DDP hang" not in capsys.readouterr().err


class _Fits(_Fails):
    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()


def test_no_marks_pile_up_when_nothing_exchanges_them(tmp_path):
    """Without the straggler exchange (``--no-diagnostics``, or no store) the step's marks are never read: on CUDA
    each is an event, two a step, for the whole run. They must not be kept (nor taken)."""
    watch = RankWatch(0, 60.0)
    cpu_trainer(max_steps=8, callbacks=[watch], default_root_dir=str(tmp_path)).fit(_Fits())
    assert watch._marks == []


def test_the_automatic_bound_stays_under_the_strategys_own_timeout(tmp_path):
    """A timeout given to the strategy (``strategy_kwargs={"timeout": ...}``, or the strategy object) and not as
    ``timeout_s``: the automatic bound must still stay under it, or the collective timeout ends the run first.
    (Fit start read with a stand-in Trainer: a real DDP fit in this process would leave its process group and
    Lightning's LOCAL_RANK/NODE_RANK/MASTER_* variables behind, and every later launch would take them for its own.)"""
    strategy = TunedDDPStrategy(timeout=40)
    assert strategy.collective_timeout_s == 40.0
    watch = RankWatch(0, None)  # what build_trainer makes when timeout_s is unset
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), collective_timeout_s=40.0),
                              world_size=1, callbacks=[], log_every_n_steps=10, accumulate_grad_batches=1)
    watch.on_fit_start(trainer, None)
    watch.hang_report_s = None
    assert watch.bound() <= 20.0


def test_a_later_fit_does_not_point_at_an_earlier_fits_report(tmp_path, capsys):
    """Two fits in one process, into two folders: the first one's hang report is not the second one's, so the
    second's collective-timeout message must not send the user to the first's folder."""
    first = hangs.HangWatch(rank=0, world_size=1, store=None, out_dir=str(tmp_path / "first"), bound=lambda: 1.0,
                            step=lambda: 3, flag="--hang-report-s")
    first.report(2.0)
    assert str(tmp_path / "first") in TunedDDPStrategy().peer_failure_hint()
    cpu_trainer(max_steps=2, callbacks=[RankWatch(None, 60.0)], default_root_dir=str(tmp_path / "second")).fit(_Fits())
    assert "hang report" not in TunedDDPStrategy().peer_failure_hint()


def test_a_later_fit_does_not_carry_an_earlier_fits_straggler(tmp_path):
    """summary.json's ``ranks`` block is the fit's: a second fit of the same Trainer starts from no finding."""
    watch = RankWatch(0, 60.0)
    watch.figures = {"straggler": {"rank": 1, "cause": "input-bound", "step": 40}, "slowest_rank": 1}
    cpu_trainer(max_steps=2, callbacks=[watch], default_root_dir=str(tmp_path)).fit(_Fits())
    assert watch.figures == {}


class _Stalls(_Fits):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            time.sleep(2.5)  # THE-STALL
        return self.layer(batch).sum()


def test_a_fit_run_from_a_thread_of_its_own_is_the_one_read(tmp_path, capsys):
    """Ray Train, a notebook helper or a user's server run ``trainer.fit`` outside the main thread: the report
    must read the thread that runs the fit, not the process's main thread."""
    trainer = cpu_trainer(max_steps=4, callbacks=[RankWatch(1.0, 60.0)], default_root_dir=str(tmp_path))
    fit = threading.Thread(target=trainer.fit, args=(_Stalls(),))
    fit.start()
    fit.join(120)
    err = capsys.readouterr().err
    assert "DDP hang" in err and "is in training_step at step 2 (test_rank_watch_fits.py:" in err, err
