"""Load per role from Prometheus' HTTP API (instant PromQL queries over the planner's window)."""
from __future__ import annotations

import json
import logging
import math
import urllib.parse
import urllib.request

from services.planner.policy import RoleLoad

logger = logging.getLogger("pdserve.planner")


class PrometheusSource:
    """Every query aggregates the role's instances, selected by the `role` label the services
    put on their metrics plus `selector` (e.g. `namespace="llm"`), which keeps deployments apart."""

    def __init__(self, url: str, window_s: float, selector: str = "", timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.window = f"{max(int(window_s), 1)}s"
        self.selector = selector.strip().strip("{}").strip().rstrip(",")
        self.timeout_s = timeout_s

    def _series(self, role: str, name: str) -> str:
        # `pdserve:x` or `pdserve_x`: an OpenMetrics scrape of prometheus_client (>= 0.22) escapes the
        # colon of the services' metric names to an underscore; a text-format scrape keeps it.
        matchers = [f'__name__=~"pdserve[:_]{name}"', f'role="{role}"', self.selector]
        return "{" + ",".join(m for m in matchers if m) + "}"

    def queries(self, role: str) -> dict[str, str]:
        w = self.window

        def m(name: str) -> str:
            return self._series(role, name)

        def p90(hist: str) -> str:
            return f"histogram_quantile(0.9, sum by (le) (rate({m(hist + '_bucket')}[{w}])))"

        q = {"pods": f"count({m('num_requests_running')})",
             "running": f"sum(avg_over_time({m('num_requests_running')}[{w}]))",
             "waiting": f"sum(avg_over_time({m('num_requests_waiting')}[{w}]))",
             "kv_cache_usage": f"avg(avg_over_time({m('kv_cache_usage_perc')}[{w}]))"}
        if role == "prefill":
            # processed + the queue's growth: the demand even when prefill is saturated
            q["prompt_tokens_per_s"] = (f"clamp_min(sum(rate({m('prompt_tokens_total')}[{w}])) + "
                                        f"(sum(deriv({m('outstanding_tokens')}[{w}])) or vector(0)), 0)")
            q["ttft_p90_s"] = p90("time_to_first_token_seconds")
            q["requests_per_s"] = f"sum(rate({m('time_to_first_token_seconds_count')}[{w}]))"
        else:
            # one ITL observation per streamed token: the generated tokens/s, counted as they go
            q["generation_tokens_per_s"] = f"sum(rate({m('inter_token_latency_seconds_count')}[{w}]))"
            q["itl_p90_s"] = p90("inter_token_latency_seconds")
        return q

    def query(self, promql: str) -> float | None:
        """The single value of an instant query; None for no data (or NaN)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus query failed: {body.get('error', body)}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    def read(self, roles) -> dict[str, RoleLoad | None]:
        out: dict[str, RoleLoad | None] = {}
        for role in roles:
            values = {name: self.query(q) for name, q in self.queries(role).items()}
            pods = int(values.pop("pods") or 0)
            out[role] = RoleLoad(pods=pods, **values) if pods else None
        return out
