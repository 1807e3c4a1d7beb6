"""``make gpu-check``: what one GPU does with the pack, beside NVIDIA's published single-GPU figures.

    python -m ddp_recipes.bench.gpucheck [--batch-size 128] [--steps 30] [--no-compile] [--out FILE]

ResNet-50 at 224 px, bf16-mixed, channels-last, synthetic data, one GPU: the pack and the raw PyTorch loop,
eager and torch.compile'd, each in fresh processes (``ddp_recipes.bench.workers``). Reports images/s, the
median step, the first step (compilation, kept out of the throughput), achieved TFLOP/s and MFU (the
GPU's bf16 peak from Lightning's table; unknown GPU: null), and writes ``bench-results/gpu.json``. About
5 minutes on an A100/H100-class GPU, most of it compiling.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ddp_recipes.config.cli import fail

PROG = "python -m ddp_recipes.bench.gpucheck"
# NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 README (pytorch-21.03 NGC container), 1 GPU, their
# training script's benchmark mode, images/s. Their model is ResNet-50 v1.5 = torchvision's resnet50.
PUBLISHED_ONE_GPU = (
    {"gpu": "A100 80GB (DGX A100)", "precision": "TF32", "batch": 256, "images_per_s": 938.0},
    {"gpu": "A100 80GB (DGX A100)", "precision": "AMP (fp16)", "batch": 256, "images_per_s": 2470.0},
    {"gpu": "V100 16GB (DGX-1)", "precision": "FP32", "batch": 112, "images_per_s": 367.0},
    {"gpu": "V100 16GB (DGX-1)", "precision": "AMP (fp16)", "batch": 256, "images_per_s": 1200.0},
)
PUBLISHED_SOURCE = "NVIDIA DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5/README.md"


def _parser() -> argparse.ArgumentParser:
    class OneLine(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # type: ignore[override]
            fail(message, PROG)

    p = OneLine(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=128, help="per-GPU batch (256 is NVIDIA's; needs ~40 GB)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per run")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps before timing (compilation included)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager runs only")
    p.add_argument("--out", default="bench-results/gpu.json", help="where the JSON goes")
    return p


def rows_with_flops(runs: list[dict[str, Any]], flops_per_sample: int | None, peak: int | None) -> list[dict]:
    """Each run's images/s with achieved TFLOP/s and MFU (None when the FLOPs or the peak are unknown)."""
    rows = []
    for run in runs:
        rate = run["global_samples_per_s"]
        achieved = flops_per_sample * rate if flops_per_sample else None
        rows.append({"impl": run["impl"], "images_per_s": round(rate, 1), "step_ms_median": round(run["step_ms_median"], 2),
                     "first_step_s": round(run["first_step_s"], 2) if run.get("first_step_s") is not None else None,
                     "achieved_tflops": round(achieved / 1e12, 2) if achieved else None,
                     "mfu": round(achieved / peak, 4) if achieved and peak else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        fail("needs a CUDA GPU (none is visible); run it on a GPU machine, or `make bench` on CPU", PROG)
    if args.batch_size < 1 or args.steps < 2 or args.warmup_steps < 1:
        fail("--batch-size must be >= 1, --steps >= 2 and --warmup-steps >= 1", PROG)
    from ddp_recipes.bench.__main__ import run_worker
    from ddp_recipes.bench.workers import Workload, build_module
    from ddp_recipes.train.perf import peak_flops, training_flops_per_sample

    settings = {"recipe": "resnet", "arch": "resnet50", "image_size": 224, "batch_size": args.batch_size,
                "steps": args.steps, "warmup_steps": args.warmup_steps, "precision": "bf16-mixed",
                "accelerator": "cuda", "threads": 0, "seed": 0, "data_dir": "", "channels_last": 1}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    impls = ["pack", "raw"] + (["pack-compiled", "raw-compiled"] if args.compile else [])
    runs, errors = [], []
    for i, impl in enumerate(impls, 1):
        print(f"[{i}/{len(impls)}] {impl}: {args.warmup_steps}+{args.steps} steps ...", file=sys.stderr, flush=True)
        try:
            runs.append(run_worker(impl, 1, settings, out.parent / "gpu-runs"))
        except Exception as err:  # noqa: BLE001 - one failed variant must not lose the others' figures
            errors.append(f"{impl}: {str(err).splitlines()[0]}")
    workload = Workload(recipe="resnet", arch="resnet50", image_size=224, channels_last=1)
    flops = training_flops_per_sample(lambda: build_module(workload), torch.empty(args.batch_size, 3, 224, 224))
    peak = peak_flops(torch.device("cuda", 0), "bf16-mixed")
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "config": settings,
              "flops_per_sample": flops, "peak_flops_per_sec": peak,
              "rows": rows_with_flops(runs, flops, peak), "errors": errors,
              "published_one_gpu": {"source": PUBLISHED_SOURCE, "rows": list(PUBLISHED_ONE_GPU)}}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_result(result))
    return 0 if runs and not errors else 1


def format_result(result: dict[str, Any]) -> str:
    lines = [f"GPU: {result['gpu']}, torch {result['torch']}; ResNet-50 224 px, bf16-mixed, channels-last, "
             f"batch {result['config']['batch_size']}, synthetic data", "",
             "| impl | images/s | step ms | first step s | TFLOP/s | MFU |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['impl']} | {r['images_per_s']} | {r['step_ms_median']} | {r['first_step_s']} | "
                     f"{r['achieved_tflops']} | {r['mfu']} |")
    lines += ["", f"Published, 1 GPU ({result['published_one_gpu']['source']}):"]
    lines += [f"- {p['gpu']} {p['precision']}, batch {p.get('batch', '?')}: {p['images_per_s']:g} images/s"
              for p in result["published_one_gpu"]["rows"]]
    lines += [f"- error: {e}" for e in result["errors"]]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
