"""What gpu-check learns about the machine before it runs anything: the GPUs the driver shows and the ones
torch sees, every version a report needs, and whether ``torch.compile`` can build its code here.

A driver that shows a GPU while torch sees none is the machine's own failure (a CPU-only torch build, a
driver older than torch's CUDA, a broken install), never a skip: :meth:`Machine.problem` says which.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

NVIDIA_SMI_TIMEOUT_S = 30.0
PACKAGES = ("torch", "torchvision", "torchmetrics", "lightning", "triton", "numpy")
_NO_DEVICES = re.compile(r"no devices were found", re.IGNORECASE)


@dataclass
class Driver:
    """What the NVIDIA driver shows: ``nvidia-smi``'s GPUs, and the device files of its kernel module."""

    tool: str | None = None  # nvidia-smi's path; None when it is not installed
    gpus: list[str] = field(default_factory=list)  # "NVIDIA H200, 143771 MiB" per GPU
    driver_version: str | None = None
    cuda_version: str | None = None  # the newest CUDA the driver supports (nvidia-smi's header)
    error: str | None = None  # nvidia-smi ran and failed (other than "No devices were found")
    device_files: int = 0  # /dev/nvidia0, /dev/nvidia1, ...

    @property
    def shows_gpus(self) -> int:
        return max(len(self.gpus), self.device_files)


@dataclass
class Machine:
    """The facts the checks and the report need; :meth:`problem` turns them into a machine verdict."""

    gpus: int  # CUDA devices torch sees
    gpu: str | None  # device 0's name
    capability: str | None
    peak_flops_per_sec: int | None  # device 0's dense bf16 peak (train/peaks.py)
    torch_cuda: str | None  # the CUDA torch was built with (None: a CPU-only build)
    cudnn: int | None
    torch_error: str | None  # why torch sees no CUDA device, in torch's words
    cuda_visible_devices: str | None
    driver: Driver
    versions: dict[str, str | None]
    python: str
    compile_problem: str | None = None  # why torch.compile cannot build code here (None: it can, or unchecked)

    def problem(self) -> tuple[str, str] | None:
        """``("fail" | "no verdict", reason)`` when no check can run; None when torch sees a GPU."""
        if self.gpus:
            return None
        shown = self.driver.shows_gpus
        torch_says = f"torch {self.versions.get('torch')} (CUDA build {self.torch_cuda or 'none: CPU-only'}) sees none"
        if self.torch_error:
            torch_says += f" ({self.torch_error})"
        if shown and self.cuda_visible_devices is not None and not _lists_a_device(self.cuda_visible_devices):
            return ("no verdict", f"CUDA_VISIBLE_DEVICES={self.cuda_visible_devices!r} hides the {shown} GPU(s) the "
                    f"driver shows; unset it to run the checks")
        if shown:
            return ("fail", f"the driver shows {shown} GPU(s) ({self.driver_summary()}) but {torch_says}")
        if self.driver.error:
            return ("fail", f"nvidia-smi is installed but failed ({self.driver.error}); {torch_says}")
        where = "no nvidia-smi, no /dev/nvidia*" if self.driver.tool is None else "nvidia-smi shows no GPU"
        return ("no verdict", f"no CUDA device on this machine ({where}); {torch_says}")

    def driver_summary(self) -> str:
        d = self.driver
        names = "; ".join(d.gpus) if d.gpus else f"{d.device_files} /dev/nvidia device file(s)"
        return f"{names}; driver {d.driver_version or '?'}, driver CUDA {d.cuda_version or '?'}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _lists_a_device(value: str) -> bool:
    """Whether a CUDA_VISIBLE_DEVICES value names any device (CUDA stops at the first invalid entry)."""
    first = value.split(",")[0].strip()
    return bool(first) and not first.startswith("-")


def read_driver(tool: str | None = None) -> Driver:
    """nvidia-smi's GPUs, driver and CUDA versions (each call bounded by a timeout), and /dev/nvidiaN."""
    found = Driver(device_files=sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)))
    found.tool = tool or shutil.which("nvidia-smi")
    if found.tool is None:
        version_file = Path("/proc/driver/nvidia/version")
        if version_file.exists():
            match = re.search(r"Kernel Module\s+(\S+)", version_file.read_text(errors="replace"))
            found.driver_version = match.group(1) if match else None
        return found
    try:
        query = subprocess.run([found.tool, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
        header = subprocess.run([found.tool], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        found.error = f"{type(err).__name__}: {err}"
        return found
    text = (query.stdout + query.stderr).strip()
    if query.returncode != 0:
        if not _NO_DEVICES.search(text):
            found.error = f"exit {query.returncode}: {text.splitlines()[0] if text else 'no output'}"
        return found
    for line in query.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            found.gpus.append(f"{parts[0]}, {parts[1]}")
            found.driver_version = parts[2]
    match = re.search(r"CUDA Version:\s*([\d.]+)", header.stdout)
    found.cuda_version = match.group(1) if match else None
    return found


def compile_problem(include_dir: str | None = None) -> str | None:
    """Why ``torch.compile`` (inductor on CUDA) cannot build code on this machine, or None.

    Triton builds a C helper on its first use: it needs a C compiler (``$CC``, else ``gcc``, else ``clang``,
    as Triton looks for one) and ``Python.h``. Both are tried the way Triton uses them, by building a tiny
    extension that includes ``Python.h``; then Triton itself must import.
    """
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return "no C compiler (gcc or clang on PATH, or $CC): Triton builds a C helper on its first use"
    if shutil.which(cc) is None:
        return f"the C compiler $CC={cc!r} is not there: Triton builds a C helper on its first use"
    if include_dir is None:
        scheme = sysconfig.get_default_scheme()
        include_dir = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if not (Path(include_dir) / "Python.h").exists():
        return (f"no Python.h in {include_dir} (the Python development headers): Triton's C helper includes it")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("#include <Python.h>\nint probe(void) { return 0; }\n")
        try:
            built = subprocess.run([cc, str(src), "-O0", "-shared", "-fPIC", "-o", str(Path(tmp) / "probe.so"),
                                    f"-I{include_dir}"], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{cc} could not build a C extension ({type(err).__name__}: {err})"
        if built.returncode != 0:
            first = (built.stderr.strip() or built.stdout.strip() or "no output").splitlines()[0]
            return f"{cc} cannot build a C extension with Python.h: {first}"
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"Triton is not installed ({err}): inductor has no GPU code generator"
    return None


def triton_runtime_problem() -> str | None:
    """Why Triton's compiled kernels cannot load or be cached on this GPU machine, or None: Triton finds
    ``libcuda.so.1`` its own way (``TRITON_LIBCUDA_PATH``, else ``ldconfig -p``, else ``LD_LIBRARY_PATH``), which
    a container without a linker cache entry fails where the driver itself loads; and Triton and inductor write
    their caches (``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``, or their defaults) on first use."""
    import getpass

    caches = (("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"),
              ("TORCHINDUCTOR_CACHE_DIR", Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"))
    for env, default in caches:
        folder = Path(os.environ.get(env) or default)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder):
                pass
        except OSError as err:
            return f"{folder} ({env}) is not writable ({type(err).__name__}): Triton and inductor cache kernels there"
    try:
        from triton.backends.nvidia.driver import libcuda_dirs

        libcuda_dirs()
    except ImportError:
        return None  # no NVIDIA backend to load: compile_problem names a missing Triton
    except Exception as err:  # its assert, ldconfig missing or failing
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return (f"Triton cannot find libcuda.so.1 ({first}); set TRITON_LIBCUDA_PATH to the folder that holds it "
                "(where the driver's library is, e.g. /usr/lib/x86_64-linux-gnu)")
    return None


def compile_blocker() -> str | None:
    """Why ``torch.compile`` cannot build and run code here, or None: THE probe, for gpu-check's compiled checks
    and the ``compiles`` pytest mark alike (a C compiler with ``Python.h``, Triton, Triton finding
    ``libcuda.so.1``, its caches writable)."""
    return compile_problem() or triton_runtime_problem()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def inspect_machine(check_compile: bool = True) -> Machine:
    """The machine as gpu-check sees it. Asks CUDA only through torch's own device queries (no context)."""
    import torch

    torch_error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if available else 0
    if not gpus:
        try:
            torch.cuda.init()  # raises with torch's own reason
        except Exception as err:  # noqa: BLE001 - the reason is the finding
            torch_error = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if torch_error is None and caught:
            torch_error = str(caught[0].message).strip().splitlines()[0]
    gpu = capability = peak = None
    if gpus:
        from ddp_recipes.train.perf import peak_flops

        gpu = torch.cuda.get_device_name(0)
        capability = "{}.{}".format(*torch.cuda.get_device_capability(0))
        peak = peak_flops(torch.device("cuda", 0), "bf16-mixed")
    versions = {name: _version(name) for name in PACKAGES}
    versions["torch"] = torch.__version__
    return Machine(gpus=gpus, gpu=gpu, capability=capability, peak_flops_per_sec=peak, torch_cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version() if gpus else None, torch_error=torch_error,
                   cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), driver=read_driver(),
                   versions=versions, python=platform.python_version(),
                   compile_problem=compile_blocker() if check_compile and gpus else None)
