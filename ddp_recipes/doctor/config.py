"""The doctor's flags (:class:`DoctorConfig`): validated, then resolved against the launcher.

Under torchrun (``world.launched_by_torchrun``) its environment is the topology and a flag may only agree
with it; otherwise the doctor spawns this node's ranks itself and fills in what the flags leave open.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field

from ddp_recipes.config.choices import ACCELERATORS, BACKENDS, check_choice
from ddp_recipes.config.cli import opt, writable_dir
from ddp_recipes.config.world import (
    cuda_devices,
    launched_by_torchrun,
    launched_per_pod,
    resolve_accelerator,
    resolve_world,
)
from ddp_recipes.errors import ConfigError
from ddp_recipes.storage import absolute

# What torchrun exports and the doctor reads.
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_FLAGS = {"devices": "--nproc-per-node", "num_nodes": "--nnodes", "node_rank": "--node-rank",
                  "master_addr": "--master-addr", "master_port": "--master-port"}

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MIN_BYTES = 4 << 10


def parse_bytes(text: str) -> int | None:
    """'64M' / '64MB' / '64MiB' -> 67108864 (binary units, as nccl-tests' -e); None for a non-size."""
    match = re.fullmatch(r"(\d+)\s*([KMG]?)I?B?", text.strip().upper())
    return int(match[1]) * UNITS[match[2]] if match else None


@dataclass
class DoctorConfig:
    """The doctor's flags; ``__post_init__`` validates them (naming the parameter) and resolves the defaults."""

    devices: int | None = opt(None, "processes on this node (default: visible CUDA GPUs, else 2 so gloo has a peer)")
    num_nodes: int | None = opt(None, "number of nodes (default 1)")
    node_rank: int | None = opt(None, "this node's index, 0 .. num-nodes - 1 (default 0)")
    master_addr: str | None = opt(None, "node 0's address (default: $MASTER_ADDR or 127.0.0.1)")
    master_port: int | None = opt(None, "rendezvous port on node 0 (default: $MASTER_PORT or a free port)")
    backend: str = opt("auto", "auto (nccl on CUDA, else gloo), gloo or nccl", choices=BACKENDS)
    accelerator: str = opt("auto", "cpu, cuda/gpu or auto (CUDA when available)", choices=ACCELERATORS)
    timeout_s: float = opt(60.0, "seconds rendezvous and each collective may take before the doctor fails")
    max_bytes: str = opt("64M", "largest all-reduce in the bandwidth sweep (4K, 16K, ... by powers of 4)")
    json: str | None = opt(None, "write the whole report as JSON to this path (rank 0 only)")
    torchrun: bool = field(init=False, default=False)
    port_from: str = field(init=False, default="flag")

    def __post_init__(self) -> None:
        for name in ("devices", "num_nodes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{{{name}}} must be >= 1 (got {value})")
        if self.json:
            # Checked before any rank starts: a bad path must not cost a whole run and end in a traceback.
            writable_dir(absolute(self.json).parent, "{json}")  # a pod may write its report to the run's bucket
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError(f"{{master_port}} must be in 1..65535 (got {self.master_port}); pick a free port")
        if self.timeout_s <= 0:
            raise ConfigError(f"{{timeout_s}} must be > 0 seconds (got {self.timeout_s})")
        if (parse_bytes(self.max_bytes) or 0) < MIN_BYTES:
            raise ConfigError(f"{{max_bytes}} must be a size >= 4K such as 64K, 1M or 64M (got {self.max_bytes!r})")
        check_choice("backend", self.backend, BACKENDS)
        self.accelerator = resolve_accelerator(self.accelerator)
        if self.backend == "auto":
            self.backend = "nccl" if self.accelerator == "cuda" else "gloo"
        if self.backend == "nccl" and self.accelerator != "cuda":
            raise ConfigError("{backend} nccl needs CUDA GPUs ({accelerator} cuda); use {backend} gloo on CPU")
        gpus = cuda_devices()
        if launched_by_torchrun():
            self._from_torchrun()
        else:
            self._for_spawn(gpus)
        if self.accelerator == "cuda" and self.devices > gpus:
            raise ConfigError(f"{{devices}} {self.devices} but only {gpus} CUDA GPU(s) are visible "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                              f"pass {{devices}} {gpus} or fewer")

    def _from_torchrun(self) -> None:
        # torchrun owns the topology; a flag that disagrees with it would be silently ignored, so refuse it.
        self.devices, self.num_nodes = resolve_world(self.devices, self.num_nodes)
        env = os.environ  # torchrun sets every one of these before it starts a worker
        theirs = {"master_addr": env["MASTER_ADDR"],
                  "node_rank": int(env.get("GROUP_RANK", int(env["RANK"]) // self.devices)),
                  "master_port": int(env["MASTER_PORT"])}
        for name, value in theirs.items():
            if getattr(self, name) not in (None, value):
                raise ConfigError(f"{{{name}}} {getattr(self, name)} disagrees with torchrun's "
                                  f"{TORCHRUN_FLAGS[name]} {value}; drop {{{name}}} under torchrun")
            setattr(self, name, value)
        self.torchrun, self.port_from = True, "torchrun"

    def _for_spawn(self, gpus: int) -> None:
        if launched_per_pod():  # one doctor per pod, as an operator starts the training script: pods are nodes
            self.num_nodes = self.num_nodes or int(os.environ["WORLD_SIZE"])
            self.node_rank = int(os.environ["RANK"]) if self.node_rank is None else self.node_rank
            if self.devices is None and self.accelerator != "cuda":
                self.devices = 1  # the operator counted one process per pod
        self.num_nodes, self.node_rank = self.num_nodes or 1, self.node_rank or 0
        if not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(f"{{node_rank}} must be in 0..{self.num_nodes - 1} for {{num_nodes}} {self.num_nodes} "
                              f"(got {self.node_rank}); number the nodes from 0")
        self.devices = self.devices or (gpus if self.accelerator == "cuda" else 2)
        self.master_addr = self.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        if self.master_port is None and os.environ.get("MASTER_PORT"):
            self.master_port, self.port_from = int(os.environ["MASTER_PORT"]), "env"
        elif self.master_port is None:
            with socket.socket() as s:  # a port the OS just handed out: free unless someone races us
                s.bind(("", 0))
                self.master_port, self.port_from = s.getsockname()[1], "free"

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes
