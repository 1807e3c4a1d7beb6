"""`python -m ddp_recipes.doctor`: the "run a minimal init script first" tip as a command.

Pre-flight checks on the launcher (flags, MASTER_ADDR/PORT, NCCL/gloo variables, versions), then on every
rank: rendezvous, an exact all-reduce and a broadcast, and an all-reduce latency/bandwidth sweep reported
like nccl-tests. Ends with ``PASS`` (exit 0) or ``FAIL: <likely cause> -- fix: <fix>`` (exit 1); bad flags
exit 2. Every wait is bounded by --timeout-s, so it never hangs.

    python -m ddp_recipes.doctor                                  # all local GPUs, else 2 CPU processes
    python -m ddp_recipes.doctor --accelerator cpu --max-bytes 1M --json doctor.json
    python -m ddp_recipes.doctor --num-nodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
    torchrun --nproc-per-node 4 -m ddp_recipes.doctor             # torchrun's processes are the ranks
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import ipaddress
import json
import os
import platform
import re
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_recipes.atomic import write_json_atomic
from ddp_recipes.config import ACCELERATORS, ConfigError, build_parser, fail, flag, opt, writable_dir

BACKENDS = ("auto", "gloo", "nccl")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_FLAGS = {"devices": "--nproc-per-node", "num_nodes": "--nnodes", "node_rank": "--node-rank",
                  "master_addr": "--master-addr", "master_port": "--master-port"}
COMM_VARS = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE",
             "NCCL_SHM_DISABLE", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "TORCH_NCCL_BLOCKING_WAIT", "GLOO_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG", "TORCH_FR_BUFFER_SIZE",
             "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MIN_BYTES = 4 << 10
CPU_BYTES_BUDGET = 128 << 20  # bytes all-reduced per size on CPU: the default sweep stays at a few seconds
DEBUG_FIX = "rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL and read the first error"


def parse_bytes(text: str) -> int | None:
    """'64M' / '64MB' / '64MiB' -> 67108864 (binary units, as nccl-tests' -e); None for a non-size."""
    match = re.fullmatch(r"(\d+)\s*([KMG]?)I?B?", text.strip().upper())
    return int(match[1]) * UNITS[match[2]] if match else None


def sweep_sizes(max_bytes: int) -> list[int]:
    """4K, 16K, 64K ... up to max_bytes: powers of 4, like nccl-tests -b 4K -e 64M -f 4."""
    return [MIN_BYTES * 4**i for i in range(32) if MIN_BYTES * 4**i <= max_bytes]


def bus_bandwidth(algbw: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2(n-1)/n, what each link of a ring carries."""
    return algbw * 2 * (world - 1) / world


def is_loopback(addr: str) -> bool:
    try:
        return addr.lower() in ("localhost", "localhost.localdomain") or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


@dataclass
class DoctorConfig:
    """The doctor's flags; ``__post_init__`` validates them (naming the flag) and resolves the defaults."""

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
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1 (got {getattr(self, name)})")
        if self.json:
            # Checked before any rank starts: a bad path must not cost a whole run and end in a traceback.
            writable_dir(os.path.dirname(os.path.abspath(self.json)), "--json")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port must be in 1..65535 (got {self.master_port}); pick a free port")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be > 0 seconds (got {self.timeout_s})")
        if (parse_bytes(self.max_bytes) or 0) < MIN_BYTES:
            raise ConfigError(f"--max-bytes must be a size >= 4K such as 64K, 1M or 64M (got {self.max_bytes!r})")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.accelerator = {"auto": "cuda" if gpus else "cpu", "gpu": "cuda"}.get(self.accelerator, self.accelerator)
        if self.accelerator == "cuda" and not gpus:
            raise ConfigError(f"--accelerator cuda but torch {torch.__version__} sees no CUDA GPU; "
                              "use --accelerator cpu")
        if self.backend == "auto":
            self.backend = "nccl" if self.accelerator == "cuda" else "gloo"
        if self.backend == "nccl" and self.accelerator != "cuda":
            raise ConfigError("--backend nccl needs CUDA GPUs (--accelerator cuda); use --backend gloo on CPU")
        if all(name in os.environ for name in TORCHRUN_VARS):
            self._from_torchrun()
        else:
            self._for_spawn(gpus)
        if self.accelerator == "cuda" and self.devices > gpus:
            raise ConfigError(f"--devices {self.devices} but only {gpus} CUDA GPU(s) are visible (CUDA_VISIBLE_DEVICES="
                              f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); pass --devices {gpus} or fewer")

    def _from_torchrun(self) -> None:
        # torchrun owns the topology; a flag that disagrees with it would be silently ignored, so refuse it.
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        theirs = {"devices": local, "num_nodes": max(1, world // local), "master_addr": os.environ["MASTER_ADDR"],
                  "node_rank": int(os.environ.get("GROUP_RANK", int(os.environ["RANK"]) // local)),
                  "master_port": int(os.environ["MASTER_PORT"])}
        for name, value in theirs.items():
            if getattr(self, name) not in (None, value):
                raise ConfigError(f"{flag(name)} {getattr(self, name)} disagrees with torchrun's "
                                  f"{TORCHRUN_FLAGS[name]} {value}; drop {flag(name)} under torchrun")
            setattr(self, name, value)
        self.torchrun, self.port_from = True, "torchrun"

    def _for_spawn(self, gpus: int) -> None:
        self.num_nodes, self.node_rank = self.num_nodes or 1, self.node_rank or 0
        if not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(f"--node-rank must be in 0..{self.num_nodes - 1} for --num-nodes {self.num_nodes} "
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


class Failure(Exception):
    """A diagnosed failure: the likely cause and its fix, printed as the FAIL line."""

    def __init__(self, cause: str, fix: str, secondary: bool = False) -> None:
        super().__init__(cause)
        self.cause, self.fix, self.secondary = cause, fix, secondary  # secondary: a symptom of another rank

    def as_dict(self) -> dict[str, Any]:
        return {"ok": False, "cause": self.cause, "fix": self.fix, "secondary": self.secondary}


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
    info = {"host": socket.gethostname(), "versions": versions(),
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
    if any(s in low for s in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")):
        return Failure(f"rank {rank} lost a peer in the {phase} step: another rank died, hung or is unreachable "
                       f"({first})", "look at the other ranks' errors first; " + DEBUG_FIX, secondary=True)
    if "nccl" in low:
        return Failure(f"NCCL error during {phase} ({first})", "rerun with NCCL_DEBUG=INFO; check NCCL_SOCKET_IFNAME, "
                       "then try NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1 to isolate the transport")
    return Failure(f"rank {rank} failed in the {phase} step: {first}", DEBUG_FIX)


def bandwidth_sweep(cfg: DoctorConfig, device: torch.device) -> list[dict[str, Any]]:
    """fp32 all-reduce time per size, algbw = bytes/time and busbw = algbw*2(n-1)/n, as nccl-tests reports."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for size in sweep_sizes(parse_bytes(cfg.max_bytes)):
        iters = 20 if device.type == "cuda" else max(3, min(20, CPU_BYTES_BUDGET // size))
        x = torch.zeros(size // 4, dtype=torch.float32, device=device)  # zeros: repeated sums never overflow
        for _ in range(max(1, iters // 4)):  # warm-up: connections, buffers, NCCL channels
            dist.all_reduce(x)
        sync()
        dist.barrier(**({"device_ids": [device.index]} if cfg.backend == "nccl" else {}))
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(seconds)  # summed here, averaged below: nccl-tests' default "-a 1"
        seconds = seconds.item() / cfg.world_size
        algbw = size / seconds / 1e9
        rows.append({"bytes": size, "count": size // 4, "iters": iters, "time_us": seconds * 1e6,
                     "algbw_gbs": algbw, "busbw_gbs": bus_bandwidth(algbw, cfg.world_size)})
    return rows


def run_rank(cfg: DoctorConfig, rank: int, local_rank: int) -> dict[str, Any]:
    """One rank: rendezvous, exact checks, gather, sweep. Never raises: a failure comes back diagnosed."""
    os.environ.update(MASTER_ADDR=cfg.master_addr, MASTER_PORT=str(cfg.master_port), RANK=str(rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(cfg.world_size))
    device = torch.device("cuda", local_rank) if cfg.accelerator == "cuda" else torch.device("cpu")
    phase, outcome, world = "init", {"ok": True, "rank": rank}, cfg.world_size
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(cfg.backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg.timeout_s))
        phase = "check"
        # An odd length, so that chunked/ring algorithms also reduce a ragged last chunk.
        x = torch.full((65_537,), float(rank + 1), device=device)
        dist.all_reduce(x)
        expected = world * (world + 1) / 2  # small integers: exact in fp32, so == is the right test
        payload = torch.arange(65_537, dtype=torch.float32, device=device)
        y = payload.clone() if rank == 0 else torch.zeros_like(payload)
        dist.broadcast(y, src=0)
        mine = {"rank": rank, "local_rank": local_rank, "world_size": dist.get_world_size(),
                "backend": dist.get_backend(), "device": str(device), "host": socket.gethostname(), "pid": os.getpid(),
                "all_reduce_ok": bool(torch.all(x == expected)), "all_reduce_got": [x.min().item(), x.max().item()],
                "broadcast_ok": bool(torch.equal(y, payload))}
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
        outcome.update(ranks=ranks, all_reduce_expected=expected)
        wrong = [r for r in ranks if not (r["all_reduce_ok"] and r["broadcast_ok"])]
        if wrong:  # every rank gathered the same list, so all of them stop here together
            what = "all-reduce" if not wrong[0]["all_reduce_ok"] else "broadcast from rank 0"
            raise Failure(f"{what} gave wrong values on rank(s) {[r['rank'] for r in wrong]} (all-reduce min/max "
                          f"{wrong[0]['all_reduce_got']}, expected {expected:g}): data is corrupted in transit",
                          "suspect the GPU peer-to-peer path: rerun with NCCL_P2P_DISABLE=1 (then NCCL_SHM_DISABLE=1)"
                          " and NCCL_DEBUG=INFO; on CPU, check GLOO_SOCKET_IFNAME")
        phase = "bandwidth"
        outcome["bandwidth"] = bandwidth_sweep(cfg, device)
    except Exception as err:  # noqa: BLE001 - every failure becomes a diagnosis, never a traceback or a hang
        outcome.update(classify(err, cfg, phase, rank).as_dict())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return outcome


def _spawned(local_rank: int, cfg: DoctorConfig, out_dir: str) -> None:
    rank = cfg.node_rank * cfg.devices + local_rank
    outcome = run_rank(cfg, rank, local_rank)
    write_json_atomic(os.path.join(out_dir, f"rank{rank}.json"), outcome, indent=None)  # never half a file
    if not outcome["ok"]:
        sys.exit(1)  # the launcher then stops the peers now rather than at the timeout


def launch(cfg: DoctorConfig) -> dict[str, Any]:
    """Spawn this node's ranks, wait no longer than the deadline, and merge their outcomes."""
    # Rendezvous may use timeout_s and the collectives after it another timeout_s; 30 s covers start-up.
    limit = 2 * cfg.timeout_s + 30
    deadline, first = time.monotonic() + limit, cfg.node_rank * cfg.devices
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-") as out_dir:
        context = mp.start_processes(_spawned, args=(cfg, out_dir), nprocs=cfg.devices, join=False,
                                     start_method="spawn")
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())), grace_period=3):
                if time.monotonic() >= deadline:
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # a rank failed: its file, or its exit code, says why
        hung = [first + i for i, p in enumerate(context.processes) if p.is_alive()]
        outcomes = {}
        for i, p in enumerate(context.processes):
            if p.is_alive():
                p.kill()
                p.join(5)
            path = os.path.join(out_dir, f"rank{first + i}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    outcomes[first + i] = json.load(fh)
            elif first + i not in hung and p.exitcode != -signal.SIGTERM:  # SIGTERM: we stopped a failed rank's peer
                outcomes[first + i] = Failure(f"rank {first + i} exited with code {p.exitcode} before reporting "
                                              "(crash, OOM kill or signal)", "check dmesg; " + DEBUG_FIX).as_dict()
    # Root causes first: "lost a peer" is a symptom of whichever rank failed on its own.
    failures = sorted((o for o in outcomes.values() if not o["ok"]), key=lambda o: (o["secondary"], o.get("rank", 0)))
    if hung:
        failures.append(Failure(f"rank(s) {hung} still running after {limit:g} s: stuck in rendezvous or a "
                                "collective", DEBUG_FIX).as_dict())
    merged = dict(outcomes.get(first, {}))
    merged.update(failures[0] if failures else {"ok": True})
    return merged


def print_preflight(cfg: DoctorConfig, info: dict[str, Any]) -> None:
    v = info["versions"]
    print(f"doctor: {cfg.devices} process(es) x {cfg.num_nodes} node(s) = world {cfg.world_size}, backend "
          f"{cfg.backend}, accelerator {cfg.accelerator}, master {cfg.master_addr}:{cfg.master_port} "
          f"({cfg.port_from}), timeout {cfg.timeout_s:g} s")
    print(f"versions: torch {v['torch']} | CUDA {v['cuda']} ({v['cuda_gpus']} GPU) | NCCL {v['nccl'] or 'n/a'} | "
          f"gloo {'yes' if v['gloo'] else 'NO'} | lightning {v['lightning']} | python {v['python']}")
    print("NCCL/gloo env: " + (", ".join(f"{k}={val}" for k, val in info["comm_env"].items()) or "none set"))
    if "NCCL_ASYNC_ERROR_HANDLING" in info["comm_env"]:
        print("note: torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING; NCCL_ASYNC_ERROR_HANDLING is the deprecated name")
    if cfg.backend == "nccl":
        print(f"hang forensics: on a collective timeout every rank dumps its last collectives to "
              f"{os.environ.get('TORCH_FR_DUMP_TEMP_FILE', '/tmp/nccl_trace_rank_')}<rank> (TunedDDPStrategy sets "
              "TORCH_FR_BUFFER_SIZE=2000, TORCH_NCCL_DUMP_ON_TIMEOUT=1); read them with python -m "
              "torch.distributed.flight_recorder.fr_trace <folder> to see which rank stopped at which collective")


def print_outcome(cfg: DoctorConfig, outcome: dict[str, Any]) -> None:
    if ranks := outcome.get("ranks"):
        print(f"{'rank':>4} {'local':>5} {'world':>5}  {'backend':<7} {'device':<8} {'host':<20} pid")
        for r in ranks:
            print(f"{r['rank']:>4} {r['local_rank']:>5} {r['world_size']:>5}  {r['backend']:<7} {r['device']:<8} "
                  f"{r['host']:<20} {r['pid']}")
        ok = ["ok" if all(r[k] for r in ranks) else "WRONG" for k in ("all_reduce_ok", "broadcast_ok")]
        print(f"all-reduce of (rank+1): expected {outcome['all_reduce_expected']:g} -> {ok[0]}; broadcast -> {ok[1]}")
    if rows := outcome.get("bandwidth"):
        print(f"all-reduce fp32, time averaged over ranks; busbw = algbw * 2(n-1)/n, n = {cfg.world_size}")
        print(f"{'size(B)':>10} {'count':>10} {'iters':>5} {'time(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11}")
        for row in rows:
            print(f"{row['bytes']:>10} {row['count']:>10} {row['iters']:>5} {row['time_us']:>10.1f} "
                  f"{row['algbw_gbs']:>11.3f} {row['busbw_gbs']:>11.3f}")


def main(argv: list[str] | None = None) -> int:
    """Run the doctor: 0 = PASS, 1 = FAIL (cause and fix printed), 2 = bad flags."""
    parser = build_parser(DoctorConfig, prog="python -m ddp_recipes.doctor",  # type: ignore[arg-type]
                          description=__doc__.splitlines()[0])
    try:
        cfg = DoctorConfig(**vars(parser.parse_args(argv)))
    except ConfigError as err:
        fail(str(err), parser.prog)
    rank = int(os.environ["RANK"]) if cfg.torchrun else cfg.node_rank * cfg.devices
    # A launcher speaks for its node; under torchrun rank 0 speaks, and another rank only for a failure
    # rank 0 cannot have seen (before the gather), pre-flight ones once per node.
    speaks = rank == 0 or not cfg.torchrun
    info, problems = preflight(cfg)
    if speaks:
        print_preflight(cfg, info)
        for p in problems[1:]:
            print(f"also: {p.cause} -- fix: {p.fix}")
    if problems:
        outcome: dict[str, Any] = problems[0].as_dict()
    elif cfg.torchrun:
        outcome = run_rank(cfg, rank, int(os.environ["LOCAL_RANK"]))
    else:
        outcome = launch(cfg)
    verdict = "PASS" if outcome["ok"] else f"FAIL: {outcome['cause']} -- fix: {outcome['fix']}"
    if speaks:
        print_outcome(cfg, outcome)
        print(verdict if rank == 0 else f"node {cfg.node_rank}: {verdict}", flush=True)
    elif not outcome["ok"] and not outcome.get("ranks") and (not problems or os.environ["LOCAL_RANK"] == "0"):
        print(f"rank {rank}: {verdict}", flush=True)
    if rank == 0 and cfg.json:
        report = {"result": verdict.split(":")[0], "config": dataclasses.asdict(cfg), "world_size": cfg.world_size,
                  **info, "problems": [p.as_dict() for p in problems], **outcome}
        write_json_atomic(cfg.json, report)
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
