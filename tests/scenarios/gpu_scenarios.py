"""What the GPU tier runs in fresh processes: ``python tests/scenarios/gpu_scenarios.py ...``.

* ``recipe ARGS``: ``recipes.resnet.main(ARGS)`` with deterministic CUDA kernels. cuDNN's default
  convolution algorithms accumulate with atomics, so two uninterrupted CUDA runs already differ in the
  last bits; a bit-for-bit resume comparison needs the kernels fixed, to test the resume and nothing else.
* anything else: ``tests/scenarios/ddp_scenarios.py`` with the same arguments, plus a spy on
  ``torch.distributed.all_reduce`` (what DDP's Python comm hooks call: the dtype and bytes of every tensor
  they send; DDP's built-in all-reduce is C++ and never shows up here) and the BatchNorm classes the model
  holds at training start; both go into each rank's record.

Lightning re-runs this same command line for every extra rank, so each mode is a plain script.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def deterministic() -> None:
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspace
    # warn_only: adaptive_avg_pool2d's backward has no flagged deterministic kernel, yet with ResNet's 1x1
    # output every input gradient gets exactly one contribution.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def spied_scenario() -> None:
    import torch
    import torch.distributed as dist

    from tests.scenarios import ddp_scenarios

    sent: list[tuple[str, int]] = []
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        sent.append((str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce  # the hooks look it up on the module at call time
    net = ddp_scenarios.Net
    start, end = net.on_train_start, net.on_train_end

    def on_train_start(self) -> None:
        start(self)
        self.record["norms"] = sorted({type(m).__name__ for m in self.modules() if "BatchNorm" in type(m).__name__})
        self.record["grad_numel"] = sum(p.numel() for p in self.parameters() if p.requires_grad)
        sent.clear()

    def on_train_end(self) -> None:
        end(self)
        self.record["sent"] = list(sent)

    net.on_train_start, net.on_train_end = on_train_start, on_train_end
    del torch
    ddp_scenarios.main()


if __name__ == "__main__":
    if sys.argv[1] == "recipe":
        deterministic()
        from recipes import resnet

        resnet.main(sys.argv[2:])
    else:
        spied_scenario()
