"""What the doctor can find wrong, each as a :class:`Failure` with its likely cause and fix: the pre-flight
checks that need no peer (run where the processes start), and the reading of a torch.distributed error."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import os
import platform
import socket
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_recipes.config.world import launch_environment

if TYPE_CHECKING:
    from ddp_recipes.doctor.config import DoctorConfig

COMM_VARS = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE",
             "NCCL_SHM_DISABLE", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "TORCH_NCCL_BLOCKING_WAIT", "GLOO_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG", "TORCH_FR_BUFFER_SIZE",
             "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")
DEBUG_FIX = "rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL and read the first error"


class Failure(Exception):
    """A diagnosed failure: the likely cause and its fix, printed as the FAIL line."""

    def __init__(self, cause: str, fix: str, secondary: bool = False) -> None:
        super().__init__(cause)
        self.cause, self.fix, self.secondary = cause, fix, secondary  # secondary: a symptom of another rank

    def as_dict(self) -> dict[str, Any]:
        return {"ok": False, "cause": self.cause, "fix": self.fix, "secondary": self.secondary}


def is_loopback(addr: str) -> bool:
    try:
        return addr.lower() in ("localhost", "localhost.localdomain") or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def port_in_use(cfg: DoctorConfig) -> Failure:
    return Failure(f"port {cfg.master_port} on {cfg.master_addr} is in use (another run still alive?)",
                   "pass --master-port <free port> or stop the other job")


def port_problem(cfg: DoctorConfig) -> Failure | None:
    # Bind as the rendezvous store will (all interfaces, SO_REUSEADDR): only a live listener fails here.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", cfg.master_port))
        except OSError:
            return port_in_use(cfg)
    return None


def ifname_problem(var: str, interfaces: list[str]) -> Failure | None:
    """A *_SOCKET_IFNAME naming no interface here: NCCL matches any prefix (``=``: exact), gloo each exact name."""
    value = os.environ.get(var, "")
    if not value or value.startswith("^"):  # "^lo,docker" only excludes: any other interface will do
        return None
    exact, gloo = value.startswith("=") or var.startswith("GLOO"), var.startswith("GLOO")
    wanted = [w.strip() for w in value.lstrip("=").split(",") if w.strip()]
    found = [w for w in wanted if any(n == w if exact else n.startswith(w) for n in interfaces)]
    if found and (len(found) == len(wanted) or not gloo):
        return None
    names = ", ".join(interfaces)
    return Failure(f"{var}={value} names no interface on {socket.gethostname()} (it has: {names})",
                   f"set {var} to the NIC of the network the nodes share (one of: {names}) or unset it")


def versions() -> dict[str, Any]:
    try:
        lightning = importlib.metadata.version("lightning")  # metadata only: importing it costs seconds
    except importlib.metadata.PackageNotFoundError:
        lightning = "not installed"
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() and dist.is_nccl_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0, "lightning": lightning,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl and str(nccl),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl_built": dist.is_available() and dist.is_nccl_available()}


def preflight(cfg: DoctorConfig) -> tuple[dict[str, Any], list[Failure]]:
    """Checks that need no peer, run where the processes start; each failure carries its fix."""
    info = {"host": socket.gethostname(), "versions": versions(), "launch": launch_environment(),
            "comm_env": {name: os.environ[name] for name in COMM_VARS if name in os.environ}}
    problems = []
    if not info["versions"]["gloo" if cfg.backend == "gloo" else "nccl_built"]:
        problems.append(Failure(f"this torch build ({torch.__version__}) has no {cfg.backend} backend",
                                "install an official torch wheel (pip install torch): it ships gloo and NCCL"))
    if cfg.num_nodes > 1 and is_loopback(cfg.master_addr):
        problems.append(Failure(f"MASTER_ADDR={cfg.master_addr} with --num-nodes {cfg.num_nodes}: other nodes cannot "
                                "reach loopback", "pass --master-addr <node-0 IP/hostname reachable from all nodes>"))
    if cfg.num_nodes > 1 and cfg.port_from == "free":
        problems.append(Failure(f"--num-nodes {cfg.num_nodes} without --master-port: each node would pick its own port",
                                "pass the same --master-port <port> on every node"))
    try:
        socket.getaddrinfo(cfg.master_addr, cfg.master_port)
    except OSError:
        problems.append(Failure(f"MASTER_ADDR={cfg.master_addr} does not resolve on {info['host']}",
                                "pass --master-addr as node 0's IP, or a hostname every node can resolve"))
    if cfg.node_rank == 0 and not cfg.torchrun:  # under torchrun, its agent is the one listening on the port
        problems.append(port_problem(cfg))
    interfaces = [name for _, name in socket.if_nameindex()]
    problems += [ifname_problem(var, interfaces) for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")]
    return info, [p for p in problems if p]


def classify(err: BaseException, cfg: DoctorConfig, phase: str, rank: int) -> Failure:
    """Map a torch.distributed exception to its likely cause and fix."""
    if isinstance(err, Failure):
        return err
    text = f"{type(err).__name__}: {err}".strip()
    low, first, where = text.lower(), text.splitlines()[0][:300], f"{cfg.master_addr}:{cfg.master_port}"
    if "address already in use" in low or "eaddrinuse" in low:
        return port_in_use(cfg)
    if "connection refused" in low or "econnrefused" in low:
        return Failure(f"nothing listens at {where} ({first})", "start node 0 first, check that --master-addr is "
                       "node 0's reachable address and that the firewall opens --master-port")
    if phase == "init" and ("timed out" in low or "timeout" in low):
        return Failure(f"rendezvous at {where} timed out after {cfg.timeout_s:g} s: not all {cfg.world_size} "
                       f"ranks arrived ({first})", "start every node with the same --num-nodes/--master-addr/"
                       "--master-port, check the firewall between the nodes, or raise --timeout-s")
    if "blocking wait" in low or "watchdog caught collective operation timeout" in low:
        return Failure(f"rank {rank}: a collective in the {phase} step hung for --timeout-s {cfg.timeout_s:g} s: "
                       f"a peer never joined it ({first})", "look at the other ranks' errors first; " + DEBUG_FIX,
                       secondary=True)
    if any(s in low for s in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")):
        return Failure(f"rank {rank} lost a peer in the {phase} step: another rank died, hung or is unreachable "
                       f"({first})", "look at the other ranks' errors first; " + DEBUG_FIX, secondary=True)
    if "nccl" in low:
        return Failure(f"NCCL error during {phase} ({first})", "rerun with NCCL_DEBUG=INFO; check NCCL_SOCKET_IFNAME, "
                       "then try NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1 to isolate the transport")
    return Failure(f"rank {rank} failed in the {phase} step: {first}", DEBUG_FIX)
