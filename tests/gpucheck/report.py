"""gpu-check's report: the overall verdict and exit code, the throughput rows with MFU, the published
reference rows, and ``gpu-report.json`` / ``gpu-report.md``.

The overall verdict, and the exit code that carries it:

====  ============  =====================================================================================
exit  verdict       when
====  ============  =====================================================================================
0     pass          every check that can run on this machine ran and passed (at least one did)
1     fail          a check failed, or the machine did (the driver shows a GPU that torch does not see)
2     (usage)       a bad flag: nothing ran
3     incomplete    nothing failed, but the budget (or an interrupt) cut or skipped a check
4     no verdict    no check could run: no CUDA device, or none of the selected checks applies here
====  ============  =====================================================================================

Checks that do not apply to this machine (``no verdict``: too few GPUs, no toolchain for
``torch.compile``) do not stop a pass; the report lists each with its reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gpucheck.runner import VERDICTS

EXIT_CODES = {"pass": 0, "fail": 1, "incomplete": 3, "no verdict": 4}
MEANING = {"pass": "every check that applies here ran and passed",
           "fail": "a check, or the machine, failed: read its reason and its output.log",
           "incomplete": "nothing failed, but not every check ran to its end: the budget ran out or the run "
                         "was interrupted; rerun what is missing with --only",
           "no verdict": "nothing could be checked on this machine"}
# 'no verdict' where --only chose the checks: the selection may be why, not the machine alone.
NO_VERDICT_ONLY = "none of the checks --only {only} selects can run on this machine (the others were not asked for)"

# NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training performance
# results" (pytorch-21.03 NGC container), the 1-GPU row. Its "mixed precision" is native AMP with fp16; no
# bf16 figure is published there, so no row is like for like with this check's bf16 run.
REFERENCE_SOURCE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "
                    "Training performance results (pytorch-21.03 NGC container), 1 GPU")
PUBLISHED = {  # (gpu, precision) -> images/s, 1 GPU, ResNet-50 v1.5 (= torchvision's resnet50)
    ("A100 80GB", "TF32"): 938.0, ("A100 80GB", "AMP fp16"): 2470.0,
    ("V100 16GB", "FP32"): 367.0, ("V100 16GB", "AMP fp16"): 1200.0,
}
REFERENCE_PRECISION = {"bf16-mixed": None, "16-mixed": "AMP fp16", "32-true": "TF32"}  # None: not published
A100_DENSE_PEAK = {"AMP fp16": 312e12, "TF32": 156e12}  # NVIDIA A100 datasheet, dense tensor-core FLOP/s


def overall(results: list[dict[str, Any]], machine_problem: tuple[str, str] | None = None,
            finished: bool = True) -> str:
    """The run's verdict from its checks' (see the module docstring)."""
    if machine_problem is not None:
        return machine_problem[0]
    seen = {r["verdict"] for r in results}
    if "fail" in seen:
        return "fail"
    if "incomplete" in seen or not finished:
        return "incomplete"
    if "pass" not in seen:
        return "no verdict"
    return "pass"


def throughput_rows(results: list[dict[str, Any]], flops_per_sample: int | None, peak: float | None) -> list[dict]:
    """The passed ResNet-50 runs with achieved TFLOP/s and MFU (None when FLOPs or peak are unknown)."""
    rows = []
    for r in results:
        if not r["name"].startswith("resnet50-") or r["verdict"] != "pass":
            continue
        rate = r["data"]["images_per_s"]
        achieved = flops_per_sample * rate if flops_per_sample else None
        rows.append({"impl": r["name"].removeprefix("resnet50-"), **r["data"],
                     "achieved_tflops": round(achieved / 1e12, 2) if achieved else None,
                     "mfu": round(achieved / peak, 4) if achieved and peak else None})
    return rows


def reference_rows(precision: str, device_peak: float | None, device_name: str | None) -> list[dict[str, Any]]:
    """NVIDIA's published 1-GPU ResNet-50 training rows for ``precision``; when none is published, one row
    saying so. A published row from another GPU is scaled by the ratio of dense peaks, and says so."""
    ref = REFERENCE_PRECISION.get(precision)
    if ref is None:
        return [{"precision": precision, "images_per_s": None, "source": REFERENCE_SOURCE,
                 "label": "unavailable: NVIDIA publishes TF32/FP32 and AMP fp16 rows for this model, no bf16 row; "
                          "fp16 and bf16 share the dense tensor-core peak on A100/H100, but a different precision "
                          "is not like for like, so no figure is shown"}]
    rows = []
    for (gpu, prec), rate in PUBLISHED.items():
        if prec != ref:
            continue
        row = {"gpu": gpu, "precision": prec, "images_per_s": rate, "source": REFERENCE_SOURCE,
               "label": "published, 1 GPU"}
        if gpu.startswith("A100") and device_peak and device_name and "A100" not in device_name:
            row["scaled_images_per_s"] = round(rate * device_peak / A100_DENSE_PEAK[prec], 1)
            row["label"] += f"; scaled to {device_name} by dense peak ({device_peak / 1e12:.0f} / " \
                            f"{A100_DENSE_PEAK[prec] / 1e12:.0f} TFLOP/s), an estimate, not a measurement"
        rows.append(row)
    return rows


def build_report(results: list[dict[str, Any]], machine: dict[str, Any], budget_s: float, elapsed_s: float,
                 rows: list[dict], reference: list[dict], config: dict[str, Any],
                 machine_problem: tuple[str, str] | None = None, finished: bool = True,
                 only: str = "") -> dict[str, Any]:
    """The report; ``only`` is gpu-check's ``--only`` (empty: every check)."""
    status = overall(results, machine_problem, finished)
    counts = {s: sum(r["verdict"] == s for r in results) for s in VERDICTS}
    meaning = MEANING[status]
    if status == "no verdict" and only and machine_problem is None:
        meaning = NO_VERDICT_ONLY.format(only=only)
    skipped = [r["name"] for r in results if r["verdict"] == "no verdict"]
    if status == "pass" and skipped:  # exit 0 must not read as 'everything ran': say what did not
        meaning += f"; not checked here (no verdict, see each reason): {', '.join(skipped)}"
    return {"verdict": status, "exit_code": EXIT_CODES[status], "meaning": meaning, "finished": finished,
            "machine_problem": machine_problem[1] if machine_problem else None, "counts": counts,
            "gpus": machine.get("gpus"), "gpu": machine.get("gpu"), "torch": machine.get("versions", {}).get("torch"),
            "peak_flops_per_sec": machine.get("peak_flops_per_sec"), "machine": machine,
            "budget_s": budget_s, "elapsed_s": round(elapsed_s, 1), "config": config, "checks": results,
            "throughput": rows, "reference": reference}


def _machine_lines(report: dict[str, Any]) -> list[str]:
    m, v = report["machine"], report["machine"].get("versions", {})
    d = m.get("driver") or {}
    gpu = f"{m.get('gpu')} x {m.get('gpus')} (compute capability {m.get('capability')})" if m.get("gpus") else "none"
    shown = "; ".join(d.get("gpus") or []) or ("nvidia-smi not installed" if d.get("tool") is None else "no GPU listed")
    lines = [f"- GPU (torch): {gpu}; the driver shows: {shown}",
             f"- driver {d.get('driver_version') or '?'}, driver CUDA {d.get('cuda_version') or '?'}; torch "
             f"{v.get('torch')} built with CUDA {m.get('torch_cuda') or 'none (CPU-only)'}, "
             f"cuDNN {m.get('cudnn') or '-'}",
             f"- Python {m.get('python')}; " + ", ".join(
                 f"{k} {v.get(k) or '-'}" for k in ("lightning", "torchvision", "torchmetrics", "triton", "numpy"))]
    if m.get("compile_problem"):
        lines.append(f"- torch.compile: {m['compile_problem']}")
    return lines


def markdown(report: dict[str, Any]) -> str:
    c = report["counts"]
    title = report["verdict"].upper()
    lines = [f"# gpu-check: {title} (exit {report['exit_code']})", "",
             f"{report['meaning'][0].upper()}{report['meaning'][1:]}. "
             f"{c['pass']} pass, {c['fail']} fail, {c['incomplete']} incomplete, "
             f"{c['no verdict']} no verdict; {report['elapsed_s']} s of a {report['budget_s']:.0f} s budget"
             + ("" if report["finished"] else "; STILL RUNNING or stopped when this was written") + ".", ""]
    if report["machine_problem"]:
        lines += [f"**Machine: {report['machine_problem']}**", ""]
    lines += _machine_lines(report) + ["", "| check | verdict | seconds | reason |", "| --- | --- | ---: | --- |"]
    lines += [f"| {r['name']} | {r['verdict']} | {r['seconds']} | {r['reason'].replace('|', '/')} |"
              for r in report["checks"]]
    if report["throughput"]:
        cfg = report["config"]
        lines += ["", f"ResNet-50, 224 px, bf16-mixed, channels-last, batch {cfg['batch_size']}, synthetic data, "
                  f"1 GPU; MFU against the dense bf16 peak {report['peak_flops_per_sec']} FLOP/s", "",
                  "| impl | images/s | step ms | first step s | TFLOP/s | MFU |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['impl']} | {r['images_per_s']} | {r['step_ms_median']} | {r['first_step_s']} | "
                  f"{r['achieved_tflops']} | {r['mfu']} |" for r in report["throughput"]]
    lines += ["", "Reference (NVIDIA, published, 1 GPU):"]
    for r in report["reference"]:
        figure = f"{r['images_per_s']:g} images/s" if r["images_per_s"] else "no figure"
        scaled = f" (~{r['scaled_images_per_s']:g} images/s scaled)" if r.get("scaled_images_per_s") else ""
        lines.append(f"- {' '.join(filter(None, (r.get('gpu'), r['precision'])))}: {figure}{scaled}; {r['label']}")
    lines += [f"- source: {report['reference'][0]['source']}"] if report["reference"] else []
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    from ddp_recipes.storage.store import write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu-report.json", out_dir / "gpu-report.md"
    write_json_atomic(json_path, report)
    md_path.write_text(markdown(report))
    return json_path, md_path
