"""The Grafana dashboard and docs/metrics.md name only metrics we export (so neither can rot
when a metric is renamed), and vLLM still names the engine metrics the dashboard reads."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from prefixmesh.api.request_metrics import DIRECT_METRICS, REQUEST_METRICS
from prefixmesh.metrics.ray_sink import PROCESS_LABELS
from prefixmesh.metrics.runtime import RUNTIME_METRICS
from prefixmesh.metrics.spec import MetricSpec, ray_names
from prefixmesh.metrics.vllm_export import VLLM_METRICS
from prefixmesh.router.core.metrics import ROUTER_METRICS

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "manifests" / "grafana" / "prefixmesh.json"
RULES = ROOT / "manifests" / "prometheus" / "rules.yml"
OURS: tuple[MetricSpec, ...] = (
    *ROUTER_METRICS,
    *REQUEST_METRICS,
    *DIRECT_METRICS,
    *RUNTIME_METRICS,
)
EXPORTED = {name for spec in (*OURS, *VLLM_METRICS) for name in ray_names(spec)}
LABELS = {"le", *PROCESS_LABELS} | {
    label for spec in (*OURS, *VLLM_METRICS) for label in spec.labels
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless", "inf", "nan"}


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return found


def names_and_labels(query: str) -> tuple[set[str], set[str]]:
    """The metric names a PromQL query reads, and the label names it matches or groups by."""
    labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", " ".join(re.findall(r"\{[^}]*\}", query))))
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", query):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    # label_values(metric, label) names a label too
    labels |= set(re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", query))
    bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]', " ", query)
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    bare = re.sub(r"label_values\(\s*(\w+)\s*,\s*\w+\s*\)", r"\1", bare)
    identifiers = re.findall(r"(?<![\w$.])([A-Za-z_:][\w:]*)\s*(\()?", bare)
    names = {name for name, call in identifiers if not call and name.lower() not in KEYWORDS}
    return names, labels


def recording_rules() -> dict[str, str]:
    """Each recorded series of rules.yml and its expression."""
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"]: rule["expr"] for group in groups for rule in group["rules"]}


def test_the_dashboard_reads_only_metrics_and_labels_we_export_or_record() -> None:
    found = queries()
    assert len(found) >= 15
    recorded = set(recording_rules())
    for query in found:
        names, labels = names_and_labels(query)
        assert names, f"no metric in {query!r}"
        assert names <= EXPORTED | recorded, (names - EXPORTED - recorded, query)
        assert labels <= LABELS, (labels - LABELS, query)
    assert any("prompt_cache_hit_ratio" in query for query in found)  # the hit rate, recorded


def test_the_recording_rules_read_what_we_export_and_prometheus_loads_them() -> None:
    import yaml

    rules = recording_rules()
    assert "prefixmesh:prompt_cache_hit_ratio:rate1m" in rules
    for record, expr in rules.items():
        names, labels = names_and_labels(expr)
        assert names and names <= EXPORTED, (record, names - EXPORTED)
        assert labels <= LABELS, (record, labels - LABELS)
    config = yaml.safe_load((ROOT / "manifests" / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == [RULES.name]


def test_the_query_parser_sees_names_labels_and_typos() -> None:
    query = (
        'histogram_quantile(0.99, sum by (le, outcome) (rate(ray_x_bucket{application="$a", '
        'field=~"q|r"}[$__rate_interval]))) / ignoring (tier) group_left sum(ray_y)'
    )
    assert names_and_labels(query) == (
        {"ray_x_bucket", "ray_y"},
        {"le", "outcome", "application", "field", "tier"},
    )


def test_every_metric_we_define_is_in_docs() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = [spec.name for spec in (*OURS, *VLLM_METRICS) if f"`{spec.name}`" not in text]
    assert missing == []


def test_the_installed_vllm_names_the_metrics_we_read() -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed")
    package = Path(spec.origin).parent / "v1" / "metrics"
    source = (package / "loggers.py").read_text()  # read, not imported: importing vLLM is slow
    assert [m.name for m in VLLM_METRICS if f'name="{m.name}"' not in source] == []
    assert "class RayPrometheusStatLogger" in (package / "ray_wrappers.py").read_text()


def test_the_prometheus_example_reads_the_service_discovery_file_we_write() -> None:
    import yaml

    from prefixmesh.local_ray import SERVICE_DISCOVERY_FILE

    config = yaml.safe_load((ROOT / "manifests" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (files,) = [sd["files"] for sd in jobs["ray"]["file_sd_configs"]]
    assert [Path(f).name for f in files] == [SERVICE_DISCOVERY_FILE]
    assert jobs["haproxy"]["static_configs"][0]["targets"][0].startswith("127.0.0.1:")
