"""Where a run executes: the accelerator, the precision it gets there, devices x nodes, and who launched
the processes. Resolved here once for the recipes, ``build_trainer``, the bench and the doctor."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ddp_recipes.config.choices import ACCELERATORS, LIGHTNING_PRECISIONS, PRECISION_SPELLINGS, check_choice
from ddp_recipes.errors import ConfigError

if TYPE_CHECKING:
    import torch  # imported where CUDA is asked about: --help and flag errors come before torch loads

# Launchers that give every process node 0's address and its own ranks (SLURM, LSF, MPI).
SCHEDULER_VARS = ("SLURM_NTASKS", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# What Kubernetes operators (Kubeflow's PyTorchJob, a JobSet's own env) give each pod when its command is
# the training script itself, without torchrun: one process per pod, RANK = the pod's index.
POD_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True under torchrun / torchelastic: it exports these (with RANK, WORLD_SIZE, MASTER_ADDR, ...)
    before starting each worker."""
    env = os.environ if env is None else env
    return "TORCHELASTIC_RUN_ID" in env and "LOCAL_WORLD_SIZE" in env


def launched_per_pod(env: Mapping[str, str] | None = None) -> bool:
    """True when an operator started this process as one of WORLD_SIZE, one per pod, without torchrun:
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set and no launcher that starts several processes
    per node (torchrun, Lightning's own, a scheduler) is in charge (those set LOCAL_RANK or their own)."""
    env = os.environ if env is None else env
    return (all(name in env for name in POD_VARS) and "LOCAL_RANK" not in env and not launched_by_torchrun(env)
            and not any(name in env for name in SCHEDULER_VARS))


def will_be_global_zero() -> bool:
    """Whether this process will be global rank 0, known before the process group exists: Lightning's rank
    from the launcher's environment (torchrun's and a pod's RANK, Lightning's own LOCAL_RANK, SLURM_PROCID)
    and, for Lightning's launcher on several nodes, NODE_RANK 0. The process that writes a run's files."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    node = os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK") or "0"
    return rank_zero_only.rank == 0 and (node == "0" or "RANK" in os.environ or "SLURM_PROCID" in os.environ)


def will_be_local_zero() -> bool:
    """Whether this process will be its node's first (local rank 0), known before the process group exists:
    torchrun's and Lightning's LOCAL_RANK, SLURM_LOCALID; a process without either is the one that launches
    the node's others (Lightning's launcher, a pod). Where a node's ``prepare_data`` runs."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


def launch_environment(env: Mapping[str, str] | None = None) -> str:
    """One line on who started this process and what it was told (the doctor prints it)."""
    env = os.environ if env is None else env
    pod = f" in Kubernetes pod {env.get('HOSTNAME', '?')}" if "KUBERNETES_SERVICE_HOST" in env else ""
    if "SLURM_NTASKS" in env:
        return (f"SLURM (job {env.get('SLURM_JOB_ID', '?')}, task {env.get('SLURM_PROCID', '?')} "
                f"of {env['SLURM_NTASKS']})")
    if launched_by_torchrun(env):
        pet = sorted(k for k in env if k.startswith("PET_"))
        told = f", configured by the operator's {', '.join(pet)}" if pet else ""
        return (f"torchrun{pod}: rank {env.get('RANK', '?')} of {env.get('WORLD_SIZE', '?')}, "
                f"{env['LOCAL_WORLD_SIZE']} per node, node {env.get('GROUP_RANK', '?')}, master "
                f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}{told}")
    if launched_per_pod(env):
        return (f"one process per pod{pod} (no torchrun): RANK {env['RANK']} of WORLD_SIZE {env['WORLD_SIZE']}, "
                f"master {env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    if any(name in env for name in SCHEDULER_VARS):
        return "a scheduler (" + ", ".join(n for n in SCHEDULER_VARS if n in env) + ")"
    return f"started directly{pod} (no launcher variables)"


def _check_operator_nodes(num_nodes: int | None, env: Mapping[str, str] | None = None) -> None:
    """Refuse a pod that an operator told it is one of several nodes (``PET_NNODES``, for torchrun to read) when
    no launcher read it: every pod would train alone into the same output dir."""
    env = os.environ if env is None else env
    nodes = env.get("PET_NNODES", "").strip()
    if (not nodes or nodes == "1" or launched_by_torchrun(env) or launched_per_pod(env)
            or any(name in env for name in SCHEDULER_VARS) or (num_nodes or 1) > 1 or "NODE_RANK" in env):
        return
    raise ConfigError(f"PET_NNODES={nodes}: the operator (a Kubeflow TrainJob or PyTorchJob) started this pod as one "
                      "of several nodes, but its command is not torchrun, so each pod would train alone; make the "
                      "container's command torchrun -m recipes.<name> (it reads the PET_* variables)")


def _pod_world(devices: int | None, num_nodes: int | None) -> tuple[int, int]:
    """One process per pod: WORLD_SIZE pods ("nodes") of one device each."""
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} (one process per pod) must be integers with "
                          "0 <= RANK < WORLD_SIZE; check the pod's environment")
    per_pod = os.environ.get("PET_NPROC_PER_NODE", "")
    if per_pod.isdigit() and int(per_pod) > 1:
        # PyTorchJob's nprocPerNode counts WORLD_SIZE in processes, while this command starts one per pod.
        raise ConfigError(f"PET_NPROC_PER_NODE={per_pod} (PyTorchJob nprocPerNode) but this pod's command is not "
                          f"torchrun: WORLD_SIZE={world} counts {per_pod} processes per pod; make the command "
                          "torchrun -m recipes.<name> (it reads the PET_* variables)")
    if devices not in (None, 1):
        raise ConfigError(f"{{devices}} {devices}, but this pod was started as one process of WORLD_SIZE {world} "
                          f"(RANK set, no torchrun): run the pod's command under torchrun --nproc-per-node {devices} "
                          "(PyTorchJob: nprocPerNode), or drop {devices}")
    if num_nodes is not None and num_nodes != int(world):
        raise ConfigError(f"{{num_nodes}} {num_nodes} disagrees with WORLD_SIZE={world} (one process per pod); "
                          "drop {num_nodes} in the pod")
    return 1, int(world)


def resolve_world(devices: int | None, num_nodes: int | None) -> tuple[int, int]:
    """Devices per node and nodes: the arguments, else torchrun's environment, else one process per pod
    (:func:`launched_per_pod`: WORLD_SIZE pods of 1), else 1 and 1."""
    if launched_per_pod():
        devices, num_nodes = _pod_world(devices, num_nodes)
    else:
        _check_operator_nodes(num_nodes)
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
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_accelerator(accelerator: str = "auto") -> str:
    """'cpu' or 'cuda'. 'gpu' means CUDA; 'auto' picks CUDA when a device is visible."""
    accelerator = accelerator.lower()
    check_choice("accelerator", accelerator, ACCELERATORS)
    if accelerator == "auto":
        return "cuda" if cuda_devices() else "cpu"
    if accelerator in ("gpu", "cuda"):
        if not cuda_devices():
            import torch

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


def lightning_precision(precision: Any, accepted: tuple[str, ...] = LIGHTNING_PRECISIONS) -> str:
    """Lightning's unified name of one of its precision spellings: ``16``/``"16"`` -> ``16-mixed``, ``"bf16"`` ->
    ``bf16-mixed``, ``32`` -> ``32-true``, ``64`` -> ``64-true`` (``PRECISION_SPELLINGS``), a unified name as it is.
    A :class:`ConfigError` naming ``{precision}`` and the ``accepted`` spellings for anything else."""
    spelled = str(precision) if isinstance(precision, int) and not isinstance(precision, bool) else precision
    if not isinstance(spelled, str) or spelled not in accepted:
        check_choice("precision", precision, accepted)  # raises: precision is not one of them
    return PRECISION_SPELLINGS.get(spelled, spelled)


def resolve_precision(precision: Any, accelerator: str) -> str:
    """The precision Lightning will run: 16-mixed on CPU becomes bf16-mixed, said once. Whether the GPU has bf16
    is checked in the rank (:func:`check_bf16_device`): asking here would initialise CUDA in the launcher."""
    precision = lightning_precision(precision)
    if precision == "16-mixed" and accelerator == "cpu":
        # Imported here: the doctor and the bench resolve accelerators without loading Lightning.
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        rank_zero_info("--precision 16-mixed needs CUDA (fp16 AMP + GradScaler); using bf16-mixed on CPU instead.")
        return "bf16-mixed"
    return precision


def check_bf16_device(precision: str, device: torch.device) -> None:
    """bf16-mixed on a CUDA device without bf16 units (``is_bf16_supported()`` counts emulation) fails here, in
    the rank, naming the fix."""
    if not precision.startswith("bf16") or device.type != "cuda":
        return
    import torch

    with torch.cuda.device(device):
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return
        name, (major, minor) = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    raise ConfigError(f"{{precision}} {precision} needs a GPU with bf16 (compute capability 8.0+, Ampere or newer); "
                      f"{name} is {major}.{minor}: use {{precision}} 16-mixed")


def check_node_env(num_nodes: int, accelerator: str = "cpu") -> None:
    """Several nodes, each started by hand: every node must know node 0's address and its own rank (without
    MASTER_ADDR node 0 waits the whole 30-minute timeout). One process per pod: RANK is the node rank, and a pod
    with several GPUs must not train on one of them while the others idle."""
    if launched_per_pod():
        _check_pod(accelerator)
        return
    if num_nodes == 1 or launched_by_torchrun() or any(name in os.environ for name in SCHEDULER_VARS):
        return
    if "NODE_RANK" not in os.environ and "GROUP_RANK" not in os.environ and "RANK" in os.environ:
        # An operator's pod without WORLD_SIZE or MASTER_PORT: it is not node 0 just because NODE_RANK is unset.
        raise ConfigError(f"RANK={os.environ['RANK']} is set but NODE_RANK is not, with {{num_nodes}} {num_nodes}: "
                          "set NODE_RANK (0..{num_nodes}-1) on every node, or give each pod RANK, WORLD_SIZE, "
                          "MASTER_ADDR and MASTER_PORT (one process per pod), or launch with torchrun")
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError(f"{{num_nodes}} {num_nodes} needs MASTER_ADDR (node 0's address), MASTER_PORT and NODE_RANK "
                          f"(0..{num_nodes - 1}) set on every node; or launch with torchrun --nnodes or srun")
    node_rank = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    if not node_rank.isdigit() or int(node_rank) >= num_nodes:
        raise ConfigError(f"NODE_RANK={node_rank} does not fit {{num_nodes}} {num_nodes}; "
                          f"set NODE_RANK to 0..{num_nodes - 1}, a different one on each node")


def _check_pod(accelerator: str) -> None:
    rank, node = os.environ["RANK"], os.environ.get("NODE_RANK")
    if node is not None and node != rank:
        raise ConfigError(f"NODE_RANK={node} but RANK={rank} in a pod that runs one process (no torchrun): the pod's "
                          "rank is its node rank; unset NODE_RANK or set it to RANK")
    gpus = cuda_devices() if accelerator == "cuda" else 0
    if gpus > 1:
        raise ConfigError(f"this pod sees {gpus} GPUs but was started as one process (RANK={rank}, "
                          f"WORLD_SIZE={os.environ['WORLD_SIZE']}, no torchrun): {gpus - 1} would idle. Run the pod's "
                          f"command under torchrun --nproc-per-node {gpus} (PyTorchJob: nprocPerNode: \"{gpus}\"), "
                          "or give the pod one GPU", "devices")


def default_num_workers(devices_per_node: int = 1) -> int:
    """Loader workers per process: this process's share of the node's CPUs (every rank starts its own), minus
    one for the training process, at most 8 (beyond, decoding rarely is the bottleneck)."""
    try:
        cpus = len(os.sched_getaffinity(0))  # honours taskset / cgroup cpusets, unlike os.cpu_count()
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(0, min(8, cpus // max(1, devices_per_node) - 1))
