"""The notebook's stand-in for Prometheus (llmopt/viz/dashboard.py) on scrapes built by hand:
histogram_quantile equals Prometheus's own (promtool evaluates the same buckets), rate() is the
counter's growth over the seconds between the scrapes, and the panel widget redraws per panel."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest

from llmopt.server.nginx import DEPLOY_DIR
from llmopt.viz.dashboard import (Scrape, dashboard_widget, evaluate, histogram_quantile, load_dashboard,
                                  panel_queries, panel_rows)

DASHBOARD = load_dashboard(DEPLOY_DIR / "grafana" / "dashboards" / "llmopt.json")
BUCKETS = [(0.1, 2.0), (0.25, 6.0), (0.5, 9.0), (1.0, 10.0), (math.inf, 10.0)]


def test_histogram_quantile_interpolates_inside_the_bucket():
    assert histogram_quantile(0.5, BUCKETS) == pytest.approx(0.1 + 0.15 * (5 - 2) / (6 - 2))
    assert histogram_quantile(0.99, BUCKETS) == pytest.approx(0.5 + 0.5 * (9.9 - 9) / (10 - 9))
    assert histogram_quantile(0.1, BUCKETS) == pytest.approx(0.1 * 1 / 2)      # first bucket starts at 0
    assert histogram_quantile(0.99, [(1.0, 5.0), (math.inf, 10.0)]) == 1.0     # +Inf bucket: largest finite bound
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))


def test_histogram_quantile_equals_prometheus(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (apt-get install prometheus)")
        pytest.skip("promtool is not installed")
    series = [{"series": f'x_bucket{{le="{"+Inf" if math.isinf(le) else le}"}}', "values": f"{count:g}"}
              for le, count in BUCKETS]
    quantiles = (0.1, 0.5, 0.9, 0.95, 0.99)
    tests = {"rule_files": [], "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": f"histogram_quantile({q}, sum by (le) (x_bucket))", "eval_time": "0m",
         "exp_samples": [{"labels": "{}", "value": histogram_quantile(q, BUCKETS)}]} for q in quantiles]}]}
    path = tmp_path / "quantiles_test.yml"
    path.write_text(json.dumps(tests))  # JSON is YAML
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def scrapes() -> tuple[Scrape, Scrape]:
    """Two replicas scraped 10 s apart; the second replica is down at the second scrape."""
    a, b = "127.0.0.1:8001", "127.0.0.1:8002"

    def lab(instance, **extra):
        return tuple(sorted({"instance": instance, **extra}.items()))

    before = Scrape(time=100.0, samples={
        ("llmopt:generation_tokens_total", lab(a)): 1000.0, ("llmopt:generation_tokens_total", lab(b)): 500.0,
        ("llmopt:prefix_cache_hits_total", lab(a)): 10.0, ("llmopt:prefix_cache_queries_total", lab(a)): 100.0,
        **{("llmopt:time_to_first_token_seconds_bucket", lab(a, le=str(le))): 0.0 for le, _ in BUCKETS}})
    after = Scrape(time=110.0, samples={
        ("llmopt:generation_tokens_total", lab(a)): 1600.0, ("llmopt:generation_tokens_total", lab(b)): 900.0,
        ("llmopt:prefix_cache_hits_total", lab(a)): 70.0, ("llmopt:prefix_cache_queries_total", lab(a)): 180.0,
        ("llmopt:num_requests_running", lab(a)): 3.0, ("llmopt:num_requests_running", lab(b)): 1.0,
        ("llmopt:kv_cache_usage_perc", lab(a)): 0.25,
        **{("llmopt:time_to_first_token_seconds_bucket", lab(a, le=str(le))): c for le, c in BUCKETS}},
        down=[b])
    return before, after


def test_queries_on_two_scrapes():
    before, after = scrapes()
    assert evaluate("sum(rate(llmopt:generation_tokens_total[$__rate_interval]))", before, after) == (600 + 400) / 10
    hit = ("sum(rate(llmopt:prefix_cache_hits_total[$__rate_interval])) / "
           "sum(rate(llmopt:prefix_cache_queries_total[$__rate_interval]))")
    assert evaluate(hit, before, after) == pytest.approx(60 / 80)
    assert evaluate("sum by (instance) (llmopt:num_requests_running)", before, after) == {
        "127.0.0.1:8001": 3.0, "127.0.0.1:8002": 1.0}
    q = "histogram_quantile(0.5, sum by (le) (rate(llmopt:time_to_first_token_seconds_bucket[$__rate_interval])))"
    assert evaluate(q, before, after) == pytest.approx(histogram_quantile(0.5, BUCKETS))
    assert evaluate('count(up{job="llmopt"} == 0)', before, after) == 1.0
    with pytest.raises(ValueError, match="query shapes"):
        evaluate("avg_over_time(llmopt:num_requests_running[5m])", before, after)


def test_every_dashboard_query_evaluates_and_the_widget_redraws_per_panel():
    before, after = scrapes()
    rows = panel_rows(DASHBOARD, before, after)
    assert {r["panel"] for r in rows} == {p["title"] for p in DASHBOARD["panels"]}
    throughput = [r for r in rows if r["series"] == "output tokens/s"]
    assert [r["value"] for r in throughput] == [100.0]
    text = panel_queries(DASHBOARD, "Prefix-cache hit rate", rows)
    assert "prefix_cache_hits_total" in text and "75.0%" in text
    with pytest.raises(ValueError, match="no panel 'Nope'"):
        panel_queries(DASHBOARD, "Nope", rows)

    w = dashboard_widget(DASHBOARD, rows)
    pick, out = w.children
    assert repr(w) == "[interactive widget: the dashboard panel by panel; run the notebook to use it]"
    first = json.dumps(out.outputs, default=str)
    pick.value = "Throughput"
    shown = json.dumps(out.outputs, default=str)
    assert shown != first and "output tokens/s" in shown and "generation_tokens_total" in shown
