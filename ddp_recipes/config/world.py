"""Where a run executes: the accelerator, the precision it gets there, devices x nodes, and who launched
the processes. Resolved here once for the recipes, ``build_trainer``, the bench and the doctor."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ddp_recipes.config.choices import ACCELERATORS, PRECISIONS, check_choice
from ddp_recipes.errors import ConfigError

# Launchers that give every process node 0's address and its own ranks (SLURM, LSF, MPI).
SCHEDULER_VARS = ("SLURM_NTASKS", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True under torchrun / torchelastic: it exports these (with RANK, WORLD_SIZE, MASTER_ADDR, ...)
    before starting each worker."""
    env = os.environ if env is None else env
    return "TORCHELASTIC_RUN_ID" in env and "LOCAL_WORLD_SIZE" in env


def resolve_world(devices: int | None, num_nodes: int | None) -> tuple[int, int]:
    """Devices per node and nodes: the arguments, else torchrun's environment, else 1 and 1."""
    if launched_by_torchrun():
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        world = int(os.environ.get("WORLD_SIZE", local))
        if devices is not None and devices != local:
            raise ConfigError(f"{{devices}} {devices} disagrees with torchrun's --nproc-per-node {local}; "
                              "drop {devices} under torchrun")
        devices, nodes_env = local, max(1, world // local)
        if num_nodes is not None and num_nodes != nodes_env:
            raise ConfigError(f"{{num_nodes}} {num_nodes} disagrees with torchrun's --nnodes {nodes_env}; "
                              "drop {num_nodes} under torchrun")
        num_nodes = nodes_env
    devices = 1 if devices is None else devices
    num_nodes = 1 if num_nodes is None else num_nodes
    if devices < 1:
        raise ConfigError(f"{{devices}} must be >= 1 (got {devices})")
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int):
        raise ConfigError(f"{{num_nodes}} must be an integer >= 1 (got {num_nodes!r})")
    if num_nodes < 1:
        raise ConfigError(f"{{num_nodes}} must be >= 1 (got {num_nodes})")
    return devices, num_nodes


def cuda_devices() -> int:
    """CUDA devices this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_accelerator(accelerator: str = "auto") -> str:
    """'cpu' or 'cuda'. 'gpu' means CUDA; 'auto' picks CUDA when a device is visible."""
    accelerator = accelerator.lower()
    check_choice("accelerator", accelerator, ACCELERATORS)
    if accelerator == "auto":
        return "cuda" if cuda_devices() else "cpu"
    if accelerator in ("gpu", "cuda"):
        if not cuda_devices():
            raise ConfigError(f"{{accelerator}} {accelerator} but torch {torch.__version__} sees no CUDA device; "
                              "use {accelerator} cpu")
        return "cuda"
    return "cpu"


def check_devices(devices: int, accelerator: str) -> None:
    """More CUDA devices per node than this node has fails now, not in the launcher."""
    if accelerator != "cuda":
        return  # a CPU run never asks CUDA: every rank of it would load the CUDA driver for nothing
    visible = cuda_devices()
    if devices > visible:
        raise ConfigError(f"{{devices}} {devices} but only {visible} CUDA device(s) are visible (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use {{devices}} {visible} or more "
                          "nodes ({num_nodes})")


def resolve_precision(precision: str, accelerator: str) -> str:
    """The precision Lightning will run, with the switch made explicit.

    16-mixed needs CUDA's fp16 kernels and a GradScaler; on CPU we switch to bf16-mixed (same memory and
    speed intent, no loss scaling needed) and say so once. Whether the GPU has bf16 is checked in the rank
    (:func:`check_bf16_device`): asking here would initialise CUDA in the launching process.
    """
    check_choice("precision", precision, PRECISIONS)
    if precision == "16-mixed" and accelerator == "cpu":
        # Imported here: the doctor and the bench resolve accelerators without loading Lightning.
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        rank_zero_info("--precision 16-mixed needs CUDA (fp16 AMP + GradScaler); using bf16-mixed on CPU instead.")
        return "bf16-mixed"
    return precision


def check_bf16_device(precision: str, device: torch.device) -> None:
    """bf16-mixed on a CUDA device without bf16 units fails here, in the rank, naming the fix.

    ``torch.cuda.is_bf16_supported()`` counts emulation as support (a V100 or T4 then runs bf16 slowly in
    emulated kernels, or fails in one without); only compute capability 8.0+ has it in hardware.
    """
    if not precision.startswith("bf16") or device.type != "cuda":
        return
    with torch.cuda.device(device):
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return
        name, (major, minor) = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    raise ConfigError(f"{{precision}} {precision} needs a GPU with bf16 (compute capability 8.0+, Ampere or newer); "
                      f"{name} is {major}.{minor}: use {{precision}} 16-mixed")


def check_node_env(num_nodes: int) -> None:
    """Several nodes, each started by hand: every node must know node 0's address and its own rank.

    Without MASTER_ADDR Lightning uses 127.0.0.1, which no other node can reach, and node 0 waits the
    whole timeout (30 minutes by default) for nodes that never arrive; fail now instead.
    """
    if num_nodes == 1 or launched_by_torchrun() or any(name in os.environ for name in SCHEDULER_VARS):
        return
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError(f"{{num_nodes}} {num_nodes} needs MASTER_ADDR (node 0's address), MASTER_PORT and NODE_RANK "
                          f"(0..{num_nodes - 1}) set on every node; or launch with torchrun --nnodes or srun")
    node_rank = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    if not node_rank.isdigit() or int(node_rank) >= num_nodes:
        raise ConfigError(f"NODE_RANK={node_rank} does not fit {{num_nodes}} {num_nodes}; "
                          f"set NODE_RANK to 0..{num_nodes - 1}, a different one on each node")


def default_num_workers(devices_per_node: int = 1) -> int:
    """Loader workers per process: this process's share of the CPUs it may run on, minus its own, at most 8.

    Every rank on a node starts its own workers, so the share divides by the devices per node; one core
    stays with the training process itself. Beyond ~8 workers decoding rarely is the bottleneck.
    """
    try:
        cpus = len(os.sched_getaffinity(0))  # honours taskset / cgroup cpusets, unlike os.cpu_count()
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(0, min(8, cpus // max(1, devices_per_node) - 1))
