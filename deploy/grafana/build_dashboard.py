"""Generates deploy/grafana/dashboards/atom-backend.json with grafana-foundation-sdk, whose
builders are generated from Grafana's dashboard schema (so the JSON has the schema's field
names and types). Edit this file, not the JSON, then:

    pip install grafana-foundation-sdk && python deploy/grafana/build_dashboard.py

tests/test_deploy.py checks the committed JSON matches this output and that every metric a
query names exists in atom_backend.metrics' exposition; tests/test_prometheus_scrape.py runs
every query against a real Prometheus.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

OUT = Path(__file__).resolve().parent / "dashboards" / "atom-backend.json"
DS = dm.DataSourceRef(type_val="prometheus", uid="prometheus")  # provisioning/datasources/prometheus.yaml
SEL = 'instance=~"$instance"'
RI = "$__rate_interval"
_ids = iter(range(1, 1000))  # stable panel ids: links and alerts refer to them


def q(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)


def quantiles(metric: str, by: str, legend_prefix: str, sel: str = SEL) -> list[prometheus.Dataquery]:
    group = f"le, {by}" if by else "le"
    return [
        q(
            f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{{{sel}}}[{RI}])))",
            f"{legend_prefix}p{int(p * 100)}",
            chr(ord("A") + i),
        )
        for i, p in enumerate((0.5, 0.9, 0.99))
    ]


def panel(title: str, unit: str, queries, description: str, stack: bool = False, bars: bool = False):
    p = (
        timeseries.Panel()
        .id(next(_ids))
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .height(8)
        .span(12)
        .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.BOTTOM).show_legend(True))
    )
    for t in queries:
        p = p.with_target(t)
    if stack:
        p = p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL)).fill_opacity(40)
    if bars:
        p = p.draw_style(cm.GraphDrawStyle.BARS)
    return p


def kind_sel() -> str:
    return f'{SEL}, layer_kind=~"$layer_kind"'


def rate_by(metric: str, by: str, sel: str = SEL) -> str:
    return f"sum by ({by}) (rate({metric}{{{sel}}}[{RI}]))"


def build() -> dict:
    global _ids
    _ids = iter(range(1, 1000))
    ks = kind_sel()
    d = (
        db.Dashboard("atom-backend")
        .uid("atom-backend")
        .description("Routing, gather traffic, kernel latency and compile events of the atom-backend vLLM attention backend")
        .tags(["vllm", "atom-backend"])
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(
            db.QueryVariable("instance")
            .label("instance")
            .datasource(DS)
            .query("label_values(atom_planner_seconds_count, instance)")
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
        # Hybrid models (gpt-oss, Gemma-3) plan each step once per layer kind, and the plans can
        # differ: the routing row repeats per kind instead of adding kinds together.
        .with_variable(
            db.QueryVariable("layer_kind")
            .label("layer kind")
            .datasource(DS)
            .query(f"label_values(atom_batches_total{{{SEL}}}, layer_kind)")
            .multi(True)
            .include_all(True)
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))  # one row per kind
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
        .with_row(db.Row("Traffic").id(next(_ids)))
        .with_panel(panel(
            "Query tokens by phase", "short",
            [q(rate_by("atom_tokens_total", "phase"), "{{phase}}", "A")],
            "New query tokens scheduled per second, counted once per engine step whatever the number of "
            "KV-cache groups. Over a window, the sum equals vLLM's prompt tokens - cached prompt tokens + "
            "generated tokens - requests (docs/metrics.md).", stack=True,
        ))
        .with_panel(panel(
            "Run-time fallbacks", "short",
            [q(f"sum by (reason, path) (increase(atom_fallbacks_total{{{SEL}}}[{RI}]))", "{{path}}: {{reason}}", "A")],
            "Fallbacks taken at run time (e.g. a kernel failed to load); should stay at zero.", bars=True,
        ))
        .with_row(db.Row("Routing: $layer_kind layers").id(next(_ids)).repeat("layer_kind"))
        .with_panel(panel(
            "Steps by path ($layer_kind)", "short",
            [q(rate_by("atom_batches_total", "layer_kind, phase, path", ks), "{{phase}} {{path}}", "A")],
            "Engine steps per second with at least one request on each phase and path, in the layers of this kind.",
        ))
        .with_panel(panel(
            "Routed tokens by path ($layer_kind)", "short",
            [q(rate_by("atom_routed_tokens_total", "layer_kind, phase, path", ks), "{{phase}} {{path}}", "A")],
            "New query tokens per second by the path the layers of this kind run them on (each step once).",
            stack=True,
        ))
        .with_panel(panel(
            "Routing reasons ($layer_kind)", "reqps",
            [q(rate_by("atom_routed_requests_total", "layer_kind, phase, path, reason", ks),
               "{{phase}} {{path}}: {{reason}}", "A")],
            "Requests per second by the planner's reason (preferred, small_prefill, gather_cost, unsupported_*, ...), "
            "each request once per step in the layers of this kind.",
            stack=True,
        ))
        .with_panel(panel(
            "Varlen prefill compute precision ($layer_kind)", "reqps",
            [q(rate_by("atom_varlen_compute_requests_total", "layer_kind, compute, reason", ks),
               "{{compute}}: {{reason}}", "A")],
            "Varlen prefill requests computed in FP8 (FP8 cache, e4m3 tensor cores) or 16 bits, with the "
            "reason when an FP8 cache is not computed in FP8 (forced_by_config: ATOM_FP8_COMPUTE=0; "
            "fp8_long_context: a request past the key limit (ATOM_FP8_COMPUTE_MAX_KEYS or the platform's); cost; "
            "unsupported_*; kernel_unavailable).",
            stack=True,
        ))
        .with_panel(panel(
            "Decode split count ($layer_kind)", "short",
            quantiles("atom_decode_num_splits", "layer_kind", "", ks)
            + [q(f"sum by (layer_kind) (rate(atom_decode_num_splits_sum{{{ks}}}[{RI}])) / "
                 f"sum by (layer_kind) (rate(atom_decode_num_splits_count{{{ks}}}[{RI}]))", "mean", "D")],
            "Split-KV splits of a step's decode batch (quantiles are bucket upper bounds: powers of two).",
        ))
        .with_row(db.Row("Gather and latency").id(next(_ids)))
        .with_panel(panel(
            "Gather bandwidth", "Bps",
            [q(rate_by("atom_gathered_bytes_total", "layer_kind"), "{{layer_kind}} layers", "A")],
            "Bytes per second the varlen gather writes into packed K and V, summed over the layers (and "
            "tensor-parallel ranks) that gather: the stack's top is the real write traffic.",
            stack=True,
        ))
        .with_panel(panel(
            "Kernel latency by path (sampled)", "s",
            quantiles("atom_kernel_seconds", "path", "{{path}} "),
            "Device time per launch from sampled event pairs (ATOM_METRICS_SAMPLE_RATE of the launches).",
        ))
        .with_panel(panel(
            "Planner time", "s",
            quantiles("atom_planner_seconds", "", ""),
            "Host time of one planner call (one per KV-cache group per engine step).",
        ))
        .with_row(db.Row("Kernels").id(next(_ids)))
        .with_panel(panel(
            "Kernel compiles and cache hits", "short",
            [
                q(f"sum by (kernel) (increase(atom_kernel_compiles_total{{{SEL}}}[{RI}]))", "compiled {{kernel}}", "A"),
                q(f"sum by (kernel) (increase(atom_kernel_cache_hits_total{{{SEL}}}[{RI}]))", "cache hit {{kernel}}", "B"),
            ],
            "Kernel variants compiled at run time (a pre-warmed image shows only cache hits).", bars=True,
        ))
        .with_panel(panel(
            "Kernel compile time", "s",
            [q(f"sum by (kernel) (increase(atom_kernel_compile_seconds_total{{{SEL}}}[{RI}]))", "{{kernel}}", "A")],
            "Seconds spent compiling or loading kernel variants.", bars=True,
        ))
    )
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
