"""``python -m launcher.search [overrides]``: the fastest layouts for the composed model, cluster
and global batch.

Enumerates TP, PP (with uneven first/last stages where the layer count needs them), VPP, CP, EP,
ZeRO stage, engine, activation recompute and micro-batch size; drops what the plan refuses and
what does not fit GPU memory less ``search.headroom``; ranks the rest by the plan's step-time
model and prints the best ``search.top_k`` (``search.format=json``: one JSON object;
``search.format=html``: every candidate plotted, predicted MFU against memory headroom, the
excluded ones grey with their reason, written to ``plan.output`` or search.html).
``search.measure=K`` then trains the best K for ``search.measure_steps`` steps each through
launcher.train and re-ranks them by measured step time. ``plan.calibrate=true`` probes this
machine at the composed layout first when no stored profile measured the model here.
Exit codes: 0 done, 2 config error or no layout fits.
"""

from __future__ import annotations

import sys

from launcher.cli import handle_flags
from launcher.cli.probe_first import needs_probe, probe_first
from launcher.compose import compose_or_exit, to_object
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.plan.plan import PlanError, compute_plan, print_problems
from launcher.search.measure import measure
from launcher.search.report import render, to_json
from launcher.search.search import search


def _print_measured(results: list) -> None:
    print("measured on this machine (fastest first):")
    for i, r in enumerate(results, 1):
        got = r["measured_step_time_s"]
        shown = f"{got:.3f} s" if got is not None else f"failed (exit {r['exit_code']})"
        print(f"{i}: {shown} (predicted {r['predicted_step_time_s']:.3f} s) "
              f"{' '.join(r['overrides'])}")


def _write_html(cfg, result) -> str:
    from launcher.html.page import write_page
    from launcher.plan.hardware import resolve_device
    from launcher.search.html_report import search_page

    device = resolve_device(cfg.cluster.gpu, cfg.cluster.device_memory_gb, cfg.cluster.peak_tflops)
    title = (f"trainwright layout search: {cfg.model.name} on {cfg.cluster.nodes:,} x "
             f"{cfg.cluster.gpus_per_node} {device.name}")
    page = search_page(result, title=title, capacity=device.memory_bytes / cfg.cluster.ranks_per_gpu,
                       top_k=cfg.search.top_k)
    return str(write_page(page, cfg.plan.output or "search.html"))


def calibrate_first(argv: list[str], cfg) -> None:
    """``plan.calibrate=true``: probe the composed layout first when nothing measured its model
    here (one probe serves every candidate layout of the model)."""
    if cfg.plan.calibrate and needs_probe(True, compute_plan(cfg).sources["step time"]):
        probe_first(argv, cfg.run.name, "search")


def main(argv: list[str] | None = None) -> int:
    argv = handle_flags(sys.argv[1:] if argv is None else argv, "launcher.search", __doc__)
    cfg = to_object(compose_or_exit(argv))
    html = cfg.search.format.value == "html"
    try:
        calibrate_first(argv, cfg)
        result = search(cfg, explain=html)
    except PlanError as exc:
        print_problems(exc)
        return CONFIG_ERROR_EXIT
    if not result.ranked:
        print(f"search: none of the {result.searched:,} layouts passes the plan's checks and "
              f"fits in {1 - cfg.search.headroom:.0%} of GPU memory (search.headroom="
              f"{cfg.search.headroom}); try more GPUs (cluster.nodes), a smaller model or "
              "sequence, or a different trainer.global_batch_size", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    top = result.ranked[:cfg.search.top_k]
    measured = None
    if cfg.search.measure:
        measured = measure(argv, top, cfg.search.measure, cfg.search.measure_steps,
                           cfg.run.output_root)
    if cfg.search.format.value == "json":
        print(to_json(result, top, measured))
        return 0
    if html:
        print(_write_html(cfg, result))
        return 0
    render(result, top)
    if measured is not None:
        _print_measured(measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
