"""Issue #20 items 6 and 8 on real GPUs (CPU twins in tests/ddp/test_cuda_paths.py); skip without CUDA."""

from __future__ import annotations

import pytest
import torch

from ddp_recipes.config.world import check_bf16_device
from ddp_recipes.ddp.failures import PEER_FAILURE_PREFIX
from ddp_recipes.errors import ConfigError
from tests.helpers import free_port
from tests.launch import start

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")


@needs_cuda
def test_bf16_check_matches_the_hardware():
    device = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(device) >= (8, 0):
        check_bf16_device("bf16-mixed", device)
    else:
        with pytest.raises(ConfigError, match="use precision 16-mixed"):
            check_bf16_device("bf16-mixed", device)


@needs_two
def test_a_dead_nccl_peer_ends_the_other_rank_with_the_pack_message():
    code = ("import os, sys, time, torch, torch.distributed as dist\n"
            "from datetime import timedelta\n"
            "from lightning.fabric.plugins.environments import LightningEnvironment\n"
            "from ddp_recipes.ddp import failures\n"
            "from ddp_recipes.ddp.strategy import TunedDDPStrategy\n"
            "rank = int(sys.argv[1]); failures.HEARTBEAT_S = 0.5; torch.cuda.set_device(rank)\n"
            "dist.init_process_group('nccl', rank=rank, world_size=2, timeout=timedelta(seconds=600))\n"
            "env = LightningEnvironment(); env.set_world_size(2); env.set_global_rank(rank)\n"
            "s = TunedDDPStrategy(process_group_backend='nccl', cluster_environment=env, timeout=6.0,\n"
            "                     parallel_devices=[torch.device('cuda', i) for i in range(2)])\n"
            "s.start_peer_watch(); x = torch.ones(1, device='cuda'); dist.all_reduce(x); torch.cuda.synchronize()\n"
            "if rank == 1: os._exit(3)\n"
            "dist.all_reduce(x); x.item()  # never completes: the peer is gone\n")
    port = free_port()
    procs = [start(["-c", code, r], port=port, quiet=None, env={"MASTER_ADDR": "127.0.0.1"}) for r in (0, 1)]
    outs = [(done.returncode, done.stdout, done.stderr) for done in (p.finish(timeout=120) for p in procs)]
    assert outs[1][0] == 3, outs[1][2][-2000:]
    assert outs[0][0] == 1, outs[0][2][-3000:]  # the watch's exit, long before the 600 s NCCL timeout
    assert PEER_FAILURE_PREFIX in outs[0][2] and "rank 1 silent" in outs[0][2]
