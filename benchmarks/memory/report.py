"""The memory bench's report: each variant against the baseline, the markdown table and the final line."""

from __future__ import annotations

from typing import Any

TARGET_REDUCTION_PCT = 30.0  # target_met: --grad-checkpointing lowers ResNet's step peak by >= 30%


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Adds reduction / slowdown vs baseline to each run; the checkpointing-vs-baseline summary."""
    by = {r["variant"]: r for r in runs}
    base = by.get("baseline")
    for r in runs:
        for key, ref in (("reduction_pct", "step_peak_mb"), ("tensor_reduction_pct", "tensor_peak_mb"),
                         ("process_reduction_pct", "process_peak_mb")):
            ok = base and base.get(ref) and r.get(ref) is not None
            r[key] = 100.0 * (1 - r[ref] / base[ref]) if ok else None
        r["slowdown"] = r["step_ms_median"] / base["step_ms_median"] if base else None
    ckpt = by.get("grad-checkpointing")
    summary: dict[str, Any] = {"baseline_mb": base["step_peak_mb"] if base else None,
                               "checkpointing_mb": ckpt["step_peak_mb"] if ckpt else None,
                               "reduction_pct": ckpt["reduction_pct"] if ckpt else None,
                               "step_cost": ckpt["slowdown"] if ckpt else None,
                               "target_reduction_pct": TARGET_REDUCTION_PCT}
    summary["target_met"] = (None if summary["reduction_pct"] is None
                             else summary["reduction_pct"] >= TARGET_REDUCTION_PCT)
    return summary


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(results: dict[str, Any]) -> str:
    """The per-variant table, with the setting and what the columns mean."""
    c = results["config"]
    lines = [f"### Memory of one training step: {c['arch']}, batch {c['batch_size']}, {c['image_size']} px, "
             f"{c['accelerator']}", "",
             "| variant | step peak MB | vs baseline | tensor peak MB | vs baseline | process peak MB "
             "| step ms | slowdown |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["runs"]:
        lines.append(f"| {r['variant']} | {_fmt(r['step_peak_mb'], '.0f')} | {_fmt(r['reduction_pct'], '+.1f', '%')} "
                     f"| {_fmt(r['tensor_peak_mb'], '.0f')} | {_fmt(r['tensor_reduction_pct'], '+.1f', '%')} "
                     f"| {_fmt(r['process_peak_mb'], '.0f')} | {_fmt(r['step_ms_median'], '.0f')} "
                     f"| {_fmt(r['slowdown'], '.2f', 'x')} |")
    lines += ["", "step peak: memory the step needs above what is resident before it (activations, gradients, "
              "workspaces); tensor peak: + weights, buffers, optimizer state, batch; process peak: "
              + ("max_memory_reserved." if c["accelerator"] == "cuda" else "peak RSS incl. Python and libraries.")
              + " 'vs baseline' is the reduction (positive = less memory).",
              f"step ms: median of {c['steps']} step(s) after the memory step"
              + ("; CPU times on a shared host are noisy, memory is not." if c["accelerator"] == "cpu" else ".")]
    lines += [f"WARNING: {w}" for w in results["warnings"]]
    lines += [f"FAILED: {e.splitlines()[0]}" for e in results["errors"]]
    return "\n".join(lines)


def summary_line(summary: dict[str, Any]) -> str:
    return (f"memory: baseline_mb={_fmt(summary['baseline_mb'], '.0f')} "
            f"checkpointing_mb={_fmt(summary['checkpointing_mb'], '.0f')} "
            f"reduction={_fmt(summary['reduction_pct'], '.1f', '%')} "
            f"step_cost={_fmt(summary['step_cost'], '.2f', 'x')}")

