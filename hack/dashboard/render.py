"""Render the chart's Grafana dashboard with real data into `docs/dashboard.png`; name the panels left empty.

Not part of `make test`: a documentation step, run by hand when the dashboard or the metrics change.

    apt-get install prometheus                 # Debian's Prometheus 2.42: the real query engine
    pip install --target /tmp/mpl matplotlib   # only this script draws with it
    PYTHONPATH=/tmp/mpl PYTHONSAFEPATH=1 .venv/bin/python hack/dashboard/render.py

What is real: the reference engines (a PP2 prefill and two decoders, each worker a process with its transfer
sidecar) and `disagg router run` serve a stepped load (concurrency 1, then 8, then 2) while a real Prometheus
scrapes the router, every engine and every sidecar each second, with the labels the chart's PodMonitor
relabelling gives them (namespace, deployment, component, pod). Every panel's PromQL is the dashboard's own,
evaluated by that Prometheus over the run (`$__rate_interval` as Grafana computes it for a 1 s scrape, 4 s).
What is not Grafana: the drawing. Grafana is not packaged for this machine, so the panels are drawn with
matplotlib in the dashboard's grid, with its titles, units and legends.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from disagg.rig.local import HOST, free_port
from disagg.rig.local_engines import LocalEngines
from disagg.rig.local_router import LocalRouter, load_run, routing_for

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "disagg" / "dashboards" / "disagg.json"
OUT = REPO / "docs" / "dashboard.png"
NAMESPACE, DEPLOYMENT = "demo", "reference-pp2"
SCRAPE_S = 1
RATE_INTERVAL = "4s"
# (concurrency, requests): the load step the screenshot shows.
STEPS = ((1, 60), (8, 600), (2, 120))
# Grafana's unit ids, as an axis label.
UNITS = {
    "s": "seconds",
    "reqps": "requests/s",
    "ops": "per second",
    "Bps": "bytes/s",
    "percentunit": "fraction",
}


def scrape_config(engines: LocalEngines, router: LocalRouter) -> dict[str, Any]:
    def target(port: int, component: str, pod: str) -> dict[str, Any]:
        labels = {"namespace": NAMESPACE, "deployment": DEPLOYMENT, "component": component, "pod": pod}
        return {"targets": [f"{HOST}:{port}"], "labels": labels}

    targets = [target(router.port, "router", "router-0")]
    for worker in [*engines.prefill, *engines.decode]:
        targets.append(target(worker.http_port, worker.worker.role, worker.name))
        targets.append(target(worker.worker.metrics_port, worker.worker.role, worker.name))
    return {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "disagg", "metrics_path": "/metrics", "static_configs": targets}],
    }


def query_range(base: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    expr = expr.replace('=~"$namespace"', f'=~"{NAMESPACE}"').replace('=~"$deployment"', f'=~"{DEPLOYMENT}"')
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1s"})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{query}", timeout=30) as response:
        answer = json.load(response)
    if answer["status"] != "success":
        raise RuntimeError(f"{expr}: {answer}")
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def legend(fmt: str, labels: dict[str, str]) -> str:
    for key, value in labels.items():
        fmt = fmt.replace("{{" + key + "}}", value).replace("{{ " + key + " }}", value)
    return fmt


def draw(
    board: dict[str, Any], base: str, start: float, end: float, steps: list[tuple[float, str]]
) -> list[str]:
    panels = [p for p in board["panels"] if p.get("type") == "timeseries"]
    columns = 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(18, 3.1 * rows), squeeze=False)
    empty = []
    for index, panel in enumerate(panels):
        axis = axes[index // columns][index % columns]
        unit = (panel.get("fieldConfig", {}).get("defaults", {}) or {}).get("unit", "")
        drew = False
        for target in panel.get("targets", []):
            for series in query_range(base, target["expr"], start, end):
                points = [
                    (float(t) - start, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf")
                ]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]) or None)
                drew = True
        if not drew:
            empty.append(panel["title"])
        axis.set_title(panel["title"], fontsize=10)
        axis.set_ylabel(UNITS.get(unit, ""), fontsize=8)
        axis.set_xlim(0, end - start)
        axis.tick_params(labelsize=7)
        for at, label in steps:
            axis.axvline(at, color="grey", linewidth=0.6, linestyle=":")
            axis.text(
                at,
                0.98,
                f" {label}",
                transform=axis.get_xaxis_transform(),
                fontsize=6,
                va="top",
                rotation=90,
                color="grey",
            )
        if drew and axis.get_legend_handles_labels()[1]:
            axis.legend(fontsize=6, loc="upper right")
        if not drew:
            axis.text(0.5, 0.5, "no series in this run", transform=axis.transAxes, ha="center", color="grey")
    for index in range(len(panels), rows * columns):
        axes[index // columns][index % columns].axis("off")
    figure.suptitle(
        f"{board['title']}: reference engines (PP2 prefill, 2 decoders) through the router, "
        "load steps at concurrency 1 → 8 → 2 (x: seconds from the first request)",
        fontsize=12,
    )
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    OUT.parent.mkdir(exist_ok=True)
    figure.savefig(OUT, dpi=80)
    return empty


def main() -> int:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        sys.exit("render.py: needs Prometheus on PATH (apt-get install prometheus)")
    board = json.loads(DASHBOARD.read_text())
    work = Path(tempfile.mkdtemp(prefix="disagg-dashboard-"))
    with LocalEngines(pp_size=2, decoders=2) as engines, LocalRouter(routing_for(engines)) as router:
        (work / "prometheus.yml").write_text(json.dumps(scrape_config(engines, router)))
        port = free_port()
        server = subprocess.Popen(
            [
                prometheus,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address={HOST}:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(work / "prometheus.log").open("wb"),
        )
        base = f"http://{HOST}:{port}"
        try:
            time.sleep(5)  # a few scrapes of the idle deployment before the load
            start = time.time()
            steps = []
            for concurrency, requests in STEPS:
                steps.append((time.time() - start, f"concurrency {concurrency}"))
                report = asyncio.run(
                    load_run(
                        router.url,
                        engines.decode_urls[0],
                        engines.model_name,
                        requests=requests,
                        concurrency=concurrency,
                    )
                )
                print(
                    f"concurrency {concurrency}: {requests} requests, {report.failed} failed, "
                    f"{report.mismatched} unlike monolithic, {report.seconds:.1f} s"
                )
            time.sleep(6)
            empty = draw(board, base, start, time.time(), steps)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {OUT.relative_to(REPO)}")
    if empty:
        print("panels with no data in this run: " + "; ".join(empty))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
