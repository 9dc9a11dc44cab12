"""Every PromQL expression of the chart's Grafana dashboard names only series the code exports: the router's
(scraped after real requests through it), the reference engine's (scraped from its real server after a
request) and the sidecar's (its registry), or vLLM's own NIXL metrics (checked against the installed vLLM's
source when it is there). A renamed metric fails this test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest
from router_rig import COMPLETION, rig, run

from disagg.rig.engine_in_process import MODEL_NAME, engine_in_process
from disagg.worker.sidecar.metrics import SidecarMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "disagg" / "dashboards" / "disagg.json"
# vLLM's NIXL connector metrics (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py): family and type.
VLLM_NIXL = {
    "vllm:nixl_bytes_transferred": "histogram",
    "vllm:nixl_xfer_time_seconds": "histogram",
    "vllm:nixl_num_failed_transfers": "counter",
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


def series_of(family: str, kind: str) -> set[str]:
    """The series names a family of `kind` is queried by (`family` as its TYPE line names it)."""
    if kind == "counter":
        base = family.removesuffix("_total")
        return {base + "_total", base + "_created"}
    if kind == "histogram":
        return {family + suffix for suffix in ("_bucket", "_sum", "_count", "_created")}
    return {family}


def exported(text: str) -> set[str]:
    return {name for family, kind in _TYPE_LINE.findall(text) for name in series_of(family, kind)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions (followed by `(`),
    grouping labels, label matchers, ranges, strings or keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b\d+(\.\d+)?(ms|[smhdwy])?\b", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def test_the_name_extraction_strips_functions_labels_and_ranges() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, outcome) (rate(a_bucket{x=~"$y",b="c{d}"}[$__rate_interval])))'
        " / on (pod) max(vllm:kv_cache_usage_perc) + sum(b_total offset 5m)"
    )
    assert metric_names(expr) == {"a_bucket", "vllm:kv_cache_usage_perc", "b_total"}


def scrape_router_and_engine(tmp_path: Path) -> tuple[str, str]:
    async def go() -> tuple[str, str]:
        async with rig() as r:
            for body in (COMPLETION, {**COMPLETION, "stream": True}):
                assert (await r.post("/v1/completions", body))[0] == 200
            async with r.client.get(r.url + "/metrics") as response:
                router = await response.text()
        async with engine_in_process(tmp_path) as (_, url), aiohttp.ClientSession() as session:
            body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200
            async with session.get(url + "/metrics") as response:
                engine = await response.text()
        return router, engine

    return run(go())


def test_every_dashboard_query_names_a_metric_the_code_exports(tmp_path: Path) -> None:
    router, engine = scrape_router_and_engine(tmp_path)
    sidecar = SidecarMetrics("prefill", "e", 0, 0).render().decode()
    names = exported(router) | exported(engine) | exported(sidecar)
    vllm_only = {n for family, kind in VLLM_NIXL.items() for n in series_of(family, kind)}
    expressions = dashboard_expressions()
    assert len(expressions) > 20
    queried = set().union(*(metric_names(e) for e in expressions))
    unknown = queried - names - vllm_only
    assert not unknown, f"the dashboard queries series nothing exports: {sorted(unknown)}"
    # The dashboard covers each component: a query of each exporter is there.
    assert queried & exported(router) and queried & exported(engine) and queried & exported(sidecar)
    # The template variables select by series the router exports too.
    board = json.loads(DASHBOARD.read_text())
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            selector, _label = variable["definition"].removeprefix("label_values(").rsplit(",", 1)
            assert metric_names(selector) <= names


def test_the_vllm_nixl_metrics_the_dashboard_names_are_vllms() -> None:
    sources = list(
        REPO.glob(".venv-vllm/lib/python3.*/site-packages/vllm/distributed/kv_transfer/**/stats.py")
    )
    text = "".join(p.read_text() for p in sources)
    if not text:
        pytest.skip("no vLLM installed (.venv-vllm, hack/vllm/venv.sh)")
    for family, kind in VLLM_NIXL.items():
        assert re.search(rf"_{kind}_cls\(\s*name=\"{re.escape(family)}\"", text), family
