"""The benchmark report: speedups from measured runs, a markdown table, ``results.json``, a plot, a summary.

Results dict (what the runner fills in; ``write_report`` writes it to ``results.json`` as is, so JSON
turns the integer keys of ``overhead_ratio`` into strings). Every top-level key but ``runs`` may be absent.

``host``         :func:`ddp_recipes.bench.hostinfo.host_facts` (cpu_count, usable_cpus, torch, ...).
``config``       the run's settings: model, per-device batch, steps, precision, accelerator, threads, ...
``ceiling``      :func:`ddp_recipes.bench.hostinfo.parallel_ceiling` (CPU runs), ``probes`` when re-probed.
``runs``         one dict per measured (impl, devices):
                   ``impl``                      "pack" (this library), "raw" (plain torch DDP), "dp", ...
                   ``devices``                   N, the world size
                   ``global_samples_per_s``      all ranks together
                   ``per_device_samples_per_s``  global / N
                   ``step_ms_median``, ``step_ms_p10``, ``step_ms_p90``  per-step wall time
                   ``peak_mem_mb_per_rank``      list, one per rank
                   ``rounds``, ``samples_per_s_range``  with ``--repeats``: the rounds measured and the
                                                 range of their throughputs (the row holds medians)
                   ``speedup``, ``efficiency``   filled by :func:`compute_speedups` when absent
                   ``achieved_flops_per_sec_per_device``, ``mfu`` (None without a known peak: CPUs),
                   ``input_wait_fraction`` (pack: share of the step waiting for the batch), ``first_step_s``
``flops``        ``per_sample`` (training FLOPs, forward + backward) and ``peak_per_device`` (or None).
``overhead_ratio`` {N: pack samples/s / raw samples/s at N}; < 1 means the pack is slower; the median of
                 the per-round ratios when the runner repeated the plan, else from :func:`overhead_ratios`.
``overhead_spread`` {N: ``median``, ``min``, ``max``, ``pairs``} of those per-round ratios (``--repeats``).
``allreduce``    one dict per N: ``devices``, ``nbytes`` (gradient bytes), ``fp32_ms``, ``bf16_ms``
                 (all-reduce with the bf16 comm hook's halved payload), ``exposed_ms`` (per-step comm time
                 not hidden under backward).
``prediction``   ``rows``: :func:`ddp_recipes.bench.commodel.predict_table` output; optional ``step_ms``,
                 ``params``, ``bytes_per_param`` (the inputs) and ``validation``
                 (:func:`~ddp_recipes.bench.commodel.validate_against_pytorch_benchmark`).
``warnings``     list of strings, shown in the report and counted in the summary line.

Speedup is weak scaling (per-device batch fixed): global samples/s at N over that impl's 1-device rate.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable
from pathlib import Path
from textwrap import fill
from typing import Any

from ddp_recipes.bench.hostinfo import ceiling_range, ceiling_words
from ddp_recipes.extras import install_hint

PLOT_DEVICES = (1, 2, 4, 8, 16)
PLOT_NEEDS = f"no speedup.png: the plot needs matplotlib: {install_hint('plot', 'matplotlib')}"


def compute_speedups(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``runs`` with ``speedup`` and ``efficiency`` vs the same impl's 1-device run (None if none)."""
    runs = [dict(r) for r in runs]
    base = {r["impl"]: r["global_samples_per_s"] for r in runs if r["devices"] == 1}
    for r in runs:
        one = base.get(r["impl"])
        if one:
            r["speedup"] = r["global_samples_per_s"] / one
            r["efficiency"] = r["speedup"] / r["devices"]
        else:
            r["speedup"] = r["efficiency"] = None
    return runs


def best_speedups(runs: Iterable[dict[str, Any]]) -> dict[int, float]:
    """{N: the highest speedup any impl measured at N}."""
    speedups = sorted((r["speedup"], r["devices"]) for r in compute_speedups(runs) if r["speedup"] is not None)
    return {n: speedup for speedup, n in speedups}  # ascending: the highest is the one kept


def overhead_ratios(runs: Iterable[dict[str, Any]], impl: str = "pack", baseline: str = "raw") -> dict[int, float]:
    """{N: impl throughput / baseline throughput} at every N both were measured at (>= 0.95 is the target;
    below 1 the pack is slower). Throughput is samples over the whole measured window, so it also counts
    per-step costs outside the median step (data loading, hooks)."""
    by = {(r["impl"], r["devices"]): r for r in runs}
    ratios = {}
    for (name, n), r in sorted(by.items()):
        other = by.get((baseline, n))
        if name != impl or other is None or not other.get("global_samples_per_s"):
            continue
        ratios[n] = r["global_samples_per_s"] / other["global_samples_per_s"]
    return ratios


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) if isinstance(value, int | float) else str(value)


def runs_table(runs: Iterable[dict[str, Any]]) -> str:
    """The measured runs as a markdown table, one row per (impl, devices)."""
    lines = ["| impl | devices | global samples/s (rounds' range) | per-device samples/s | step ms p50 (p10-p90) "
             "| peak MB/rank | speedup | efficiency | GFLOP/s per device | MFU | input wait |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(runs, key=lambda r: (r["impl"], r["devices"])):
        spread = f"{_fmt(r.get('step_ms_median'), '.1f')} ({_fmt(r.get('step_ms_p10'), '.1f')}-" \
                 f"{_fmt(r.get('step_ms_p90'), '.1f')})"
        mem = r.get("peak_mem_mb_per_rank") or []
        eff = r.get("efficiency")
        flops = r.get("achieved_flops_per_sec_per_device")
        lines.append(
            f"| {r['impl']} | {r['devices']} | {_fmt(r['global_samples_per_s'], '.1f')}{_range(r)} "
            f"| {_fmt(r.get('per_device_samples_per_s'), '.1f')} | {spread} | {_fmt(max(mem) if mem else None, '.0f')} "
            f"| {_fmt(r.get('speedup'))} "
            f"| {_fmt(eff * 100 if eff is not None else None, '.0f')}{'%' if eff is not None else ''} "
            f"| {_fmt(flops / 1e9 if flops else None, '.1f')} | {_fmt(r.get('mfu'), '.1%')} "
            f"| {_fmt(r.get('input_wait_fraction'), '.1%')} |"
        )
    return "\n".join(lines)


def _range(row: dict[str, Any]) -> str:
    span = row.get("samples_per_s_range")
    if not span or row.get("rounds", 1) < 2:
        return ""
    return f" ({_fmt(span[0], '.1f')}-{_fmt(span[1], '.1f')})"


def _allreduce_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| devices | gradient MB | fp32 all-reduce ms | bf16-hook all-reduce ms | exposed ms/step |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: r["devices"]):
        nbytes = r.get("nbytes")
        lines.append(f"| {r['devices']} | {_fmt(nbytes / 1e6 if nbytes else None, '.1f')} | "
                     f"{_fmt(r.get('fp32_ms'))} | {_fmt(r.get('bf16_ms'))} | {_fmt(r.get('exposed_ms'))} |")
    return "\n".join(lines)


def _prediction_table(rows: list[dict[str, Any]]) -> str:
    links = list(dict.fromkeys(r["link"] for r in rows))
    devices = sorted({r["devices"] for r in rows})
    cell = {(r["link"], r["devices"]): r for r in rows}
    lines = ["| link | GB/s | " + " | ".join(f"N={n} ring / central" for n in devices) + " |",
             "| --- | ---: |" + " ---: |" * len(devices)]
    for link in links:
        first = next(r for r in rows if r["link"] == link)
        cells = []
        for n in devices:
            r = cell.get((link, n))
            cells.append(f"{r['speedup']:.2f}x / {r['central_speedup']:.2f}x" if r else "-")
        lines.append(f"| {link} | {_fmt(first.get('bandwidth_GBps'), 'g')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(results: dict[str, Any]) -> str:
    """The whole report as markdown: host, ceiling, runs, overhead, all-reduce, prediction, warnings."""
    runs = results.get("runs") or []
    if any("speedup" not in r for r in runs):
        runs = compute_speedups(runs)
    parts = ["# DDP benchmark", ""]
    host = results.get("host") or {}
    if host:
        gpus = ", ".join(host.get("cuda_devices") or []) or "none"
        parts += [f"Host: {host.get('usable_cpus', '?')} usable CPUs (of {host.get('cpu_count', '?')}), GPUs: {gpus}, "
                  f"torch {host.get('torch', '?')}, lightning {host.get('lightning', '?')}.", ""]
    config = results.get("config") or {}
    if config:
        parts += ["Config: " + ", ".join(f"{k}={v}" for k, v in config.items()) + ".", ""]
    ceiling = results.get("ceiling")
    if ceiling:
        measured = best_speedups(runs).get(ceiling["workers"])
        parts += [f"Host parallel ceiling (single-thread matmul probe): {ceiling_words(ceiling, measured)}.", ""]
    parts += ["## Measured", "", runs_table(runs), ""]
    ratios = results.get("overhead_ratio")
    if ratios is None:
        ratios = overhead_ratios(runs)
    writeup = overhead_ratios(runs, baseline="writeup")
    if writeup:
        parts += ["Pack throughput over the write-up's original script: "
                  + ", ".join(f"N={n}: {v:.2f}x" for n, v in writeup.items()), ""]
    spread = results.get("overhead_spread") or {}
    if ratios:
        def ratio_text(n: Any, v: float) -> str:
            s = spread.get(n) or spread.get(str(n))
            if not s or s.get("pairs", 1) < 2:
                return f"N={n}: {v:.3f}x"
            return f"N={n}: {v:.3f}x (median of {s['pairs']} interleaved pairs, {s['min']:.3f}-{s['max']:.3f})"
        parts += ["Pack throughput as a fraction of the raw DDP loop's (target >= 0.97): "
                  + ", ".join(ratio_text(n, v) for n, v in ratios.items()), ""]
    for key, text in (("plain_overhead_spread", "Pack throughput as a fraction of plain Lightning's "
                                                 "(L.Trainer(strategy=\"ddp\"))"),
                      ("plain_over_raw_spread", "Plain Lightning's throughput as a fraction of the raw DDP loop's"),
                      ("compiled_overhead_spread", "Compiled pack throughput as a fraction of the compiled raw "
                                                    "loop's"),
                      ("compile_speedup", "torch.compile speedup of the pack (compiled / eager, steady state)")):
        pairs = results.get(key) or {}
        if pairs:
            parts += [f"{text}: " + ", ".join(f"N={n}: {v['median']:.3f}x ({v['min']:.3f}-{v['max']:.3f}, "
                                              f"{v['pairs']} pair(s))" for n, v in pairs.items()), ""]
    first = [r for r in runs if r.get("first_step_s") is not None and r["impl"].endswith("-compiled")]
    if first:
        parts += ["Compile time (the first step, not in the throughput): " + ", ".join(
            f"{r['impl']} N={r['devices']}: {r['first_step_s']:.1f} s" for r in first), ""]
    diag = results.get("diagnostics_overhead")
    if diag:
        parts += ["DDPDiagnostics cost (host time in its hooks, slowest rank, per timed step; target < 1%): "
                  + ", ".join(f"N={d['devices']}: {d['ms_per_step']:.2f} ms = {d['fraction_of_step']:.3%}"
                              for d in diag), ""]
    hooks = results.get("hook_overhead") or {}
    if hooks:
        parts += ["Host ms per timed step inside each pack callback's hooks (slowest rank): " + "; ".join(
            f"N={n}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in per.items()) for n, per in hooks.items()), ""]
    if results.get("allreduce"):
        parts += ["## Communication", "", _allreduce_table(results["allreduce"]), ""]
    prediction = results.get("prediction") or {}
    if prediction.get("rows"):
        inputs = ", ".join(f"{k}={_fmt(prediction[k], 'g')}" for k in ("step_ms", "params", "bytes_per_param")
                           if k in prediction)
        parts += ["## Predicted (ring all-reduce model; central server for contrast)", ""]
        if inputs:
            parts += [f"From {inputs}.", ""]
        parts += [_prediction_table(prediction["rows"]), ""]
        val = prediction.get("validation")
        if val:
            parts += [f"Model check against PyTorch's DDP benchmark ({val['model']}, {val['devices']} GPUs, "
                      f"{val['link']}): predicted {val['predicted_efficiency']:.1%} vs published "
                      f"{val['published_efficiency']:.1%} efficiency ({val['error_points']:+.1f} points).", ""]
    warnings = results.get("warnings") or []
    if warnings:
        parts += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    return "\n".join(parts)


def summary_line(results: dict[str, Any]) -> str:
    """One parseable line: ``bench: key=value ...`` with the largest N's speedup per impl."""
    runs = results.get("runs") or []
    if any("speedup" not in r for r in runs):
        runs = compute_speedups(runs)
    fields = []
    for impl in dict.fromkeys(r["impl"] for r in runs):
        top = max((r for r in runs if r["impl"] == impl), key=lambda r: r["devices"])
        fields.append(f"{impl}_speedup@{top['devices']}={_fmt(top.get('speedup'))}")
        fields.append(f"{impl}_efficiency@{top['devices']}={_fmt(top.get('efficiency'), '.3f')}")
    ratios = results.get("overhead_ratio") or overhead_ratios(runs)
    if ratios:
        n, value = max(ratios.items(), key=lambda kv: int(kv[0]))
        fields.append(f"overhead@{n}={value:.3f}")
    if results.get("ceiling"):
        fields.append(f"ceiling@{results['ceiling']['workers']}={results['ceiling']['ceiling']:.2f}")
    val = (results.get("prediction") or {}).get("validation")
    if val:
        fields.append(f"model_error_points={val['error_points']:+.1f}")
    fields.append(f"warnings={len(results.get('warnings') or [])}")
    return "bench: " + " ".join(fields)


def prediction_groups(rows: list[dict[str, Any]], tolerance: float = 0.005) -> list[dict[str, Any]]:
    """The predicted efficiency curves, one per group of links whose curves would overlap on the plot.

    ``rows`` are :func:`~ddp_recipes.bench.commodel.predict_table` rows. Links are taken fastest first; a
    link joins the first group whose curve is within ``tolerance`` (efficiency, 0.005 = half a point) of its
    own at every N, else starts a group. Each group: ``links`` (names), ``points`` [(N, efficiency)] of its
    first (fastest) link, N = 1 at 1.0 included. Sorted by efficiency at the largest N, best first.
    """
    bandwidth = {r["link"]: r.get("bandwidth_GBps", 0) for r in rows}
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        curves.setdefault(r["link"], []).append((r["devices"], r["efficiency"]))
    groups: list[dict[str, Any]] = []
    for link in sorted(curves, key=lambda name: -bandwidth[name]):
        points = sorted(curves[link])
        if points[0][0] != 1:
            points.insert(0, (1, 1.0))
        for group in groups:
            if dict(group["points"]).keys() == dict(points).keys() and all(
                    abs(a - b) <= tolerance for (_, a), (_, b) in zip(group["points"], points, strict=True)):
                group["links"].append(link)
                break
        else:
            groups.append({"links": [link], "points": points})
    return sorted(groups, key=lambda g: -g["points"][-1][1])


def speedup_figure(results: dict[str, Any]):
    """The scaling plot as a matplotlib Figure (the caller closes it): efficiency (speedup / N) per N on
    a percent axis, measured per impl with each point's speedup written beside it, ideal (100%), the host's
    parallel ceiling on CPU, and the model's prediction once per group of links predicting the same curve."""
    import matplotlib

    matplotlib.use("Agg")  # headless; also inside a rank or a test
    import matplotlib.pyplot as plt

    runs = compute_speedups(results.get("runs") or [])
    rows = (results.get("prediction") or {}).get("rows") or []
    measured = {impl: sorted((r["devices"], r["efficiency"], r["speedup"]) for r in runs
                             if r["impl"] == impl and r.get("efficiency") is not None)
                for impl in dict.fromkeys(r["impl"] for r in runs)}
    xs = sorted(set(PLOT_DEVICES) | {r["devices"] for r in runs})
    ceiling = results.get("ceiling")
    values = [e for pts in measured.values() for _, e, _ in pts] + [r["efficiency"] for r in rows] + [1.0]
    if ceiling:
        values.append(ceiling_range(ceiling)[0] / ceiling["workers"])
    low = max(0.0, min(values) - 0.05)
    # Curves closer than ~1.5% of the axis would be drawn on top of each other: draw them as one line.
    groups = prediction_groups(rows, tolerance=max(0.005, 0.015 * (1.02 - low)))
    # The legend goes below the axes (never over the data) and the layout keeps the title inside the figure.
    fig, ax = plt.subplots(figsize=(9, 7), layout="constrained")
    ax.plot(xs, [100.0] * len(xs), color="black", linestyle=":", label="ideal (100%)")
    cmap = plt.get_cmap("viridis")
    for i, group in enumerate(groups):
        n, e = zip(*group["points"], strict=True)
        ax.plot(n, [100 * v for v in e], color=cmap(i / max(1, len(groups) - 1) * 0.9), linestyle="--",
                linewidth=1.2, label="predicted: " + ", ".join(group["links"]))
    if ceiling:
        w = ceiling["workers"]
        label = fill("host parallel ceiling: " + ceiling_words(ceiling, best_speedups(runs).get(w)), 64)
        for i, probe in enumerate(ceiling.get("probes") or [ceiling["ceiling"]]):  # a short bar per probe
            ax.plot([w / 1.12, w * 1.12], [100 * probe / w] * 2, color="dimgray", linewidth=3,
                    label=None if i else label)
    styles = zip(("crimson", "darkorange", "magenta", "saddlebrown", "gray"), "osD^v", strict=True)
    placed: dict[int, list[float]] = {}  # the labelled points at each N, so close labels are stacked, not overlaid
    for (impl, pts), (color, marker) in zip(measured.items(), styles, strict=False):
        if not pts:
            continue
        n, e, speedup = zip(*pts, strict=True)
        ax.plot(n, [100 * v for v in e], color=color, marker=marker, linewidth=2.5, markersize=8,
                label=f"measured {impl}")
        for x, y, sp in zip(n, e, speedup, strict=True):
            if x > 1:
                near = sum(abs(y - other) < 0.03 * (1.02 - low) for other in placed.setdefault(x, []))
                placed[x].append(y)
                ax.annotate(f"{sp:.2f}x", (x, 100 * y), textcoords="offset points", xytext=(9, -3 - 10 * near),
                            fontsize=8, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(100 * low, 102)
    ax.set_xlabel("devices N (per-device batch fixed)")
    ax.set_ylabel("scaling efficiency = speedup / N (%)")
    ax.set_title("DDP scaling efficiency (measured speedup beside each point)")
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    return fig


def plot_speedup(results: dict[str, Any], path: str | Path) -> Path:
    """Write :func:`speedup_figure` to ``path`` (PNG)."""
    fig = speedup_figure(results)  # sets the headless backend before pyplot is imported here
    import matplotlib.pyplot as plt

    try:
        path = Path(path)
        fig.savefig(path, dpi=110, bbox_inches="tight")  # whatever the legend's width, nothing is cut
    finally:
        plt.close(fig)
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


def can_plot() -> bool:
    """Whether matplotlib (the ``plot`` extra) is installed: the report is written either way."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_report(results: dict[str, Any], out_dir: str | Path = "bench-results") -> dict[str, Path]:
    """Write ``results.json``, ``report.md`` and, where matplotlib is installed, ``speedup.png`` into
    ``out_dir``; the paths written (no ``plot`` without matplotlib: say :data:`PLOT_NEEDS` then)."""
    results = copy.deepcopy(results)
    runs = results.get("runs") or []
    if any("speedup" not in r for r in runs):
        results["runs"] = runs = compute_speedups(runs)
    if "overhead_ratio" not in results:
        results["overhead_ratio"] = overhead_ratios(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(results, indent=2, default=_jsonable) + "\n")
    paths["markdown"].write_text(markdown_report(results))
    if can_plot():
        paths["plot"] = plot_speedup(results, out / "speedup.png")
    return paths
