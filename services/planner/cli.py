"""`pdserve planner`: flags (each with a PDSERVE_PLANNER_* environment variable) and the process main."""
from __future__ import annotations

import argparse
import logging
import signal
import threading

from services.common.flags import add
from services.planner.config import ROLES, PlannerConfig, RoleTargets, SlaTargets, Stability

logger = logging.getLogger("pdserve.planner")
ENV_PREFIX = "PDSERVE_PLANNER_"


def _flag(p, flag: str, help: str, **kwargs) -> None:
    add(p, flag, env_prefix=ENV_PREFIX, help=help, **kwargs)


def _addresses(value: str) -> list[str]:
    return [a.strip() for a in (value or "").split(",") if a.strip()]


def add_planner_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "planner", help="autoscaler: sizes the prefill and decode Deployments separately from their metrics",
        description="Reads the services' metrics (Prometheus, or the pods' /metrics directly) and sets the "
                    "replicas of the prefill Deployment from the prompt-token rate and TTFT, and of the decode "
                    "Deployment from the generation rate, KV cache usage and ITL.")
    g = p.add_argument_group("Kubernetes")
    _flag(g, "--namespace", "namespace of the Deployments and Services (default: the pod's own)")
    _flag(g, "--prefill-deployment", "prefill Deployment to scale (unset: prefill is not scaled)", default="")
    _flag(g, "--decode-deployment", "decode Deployment to scale (unset: decode is not scaled)", default="")
    _flag(g, "--kubeconfig", "kubeconfig file (default: the in-cluster service account, else ~/.kube/config)")
    _flag(g, "--kube-api-url", "API server URL reached without credentials (e.g. `kubectl proxy`)")
    g = p.add_argument_group("metrics")
    _flag(g, "--metrics-source", "where the load is read: prometheus (needs --prometheus-url) or scrape "
          "(the pods' /metrics)", default="prometheus", choices=["prometheus", "scrape"])
    _flag(g, "--prometheus-url", "Prometheus base URL, e.g. http://prometheus-operated.monitoring:9090")
    _flag(g, "--prometheus-selector", "extra PromQL label matchers for this deployment, e.g. namespace=\"llm\"",
          default="")
    _flag(g, "--prefill-service", "scrape: headless Service of the prefill pods (EndpointSlices)", default="")
    _flag(g, "--decode-service", "scrape: headless Service of the decode pods (EndpointSlices)", default="")
    _flag(g, "--metrics-port-name", "scrape: the Services' port name for /metrics", default="metrics")
    _flag(g, "--prefill-metrics", "scrape: static prefill metrics addresses host:port[,...]", default="")
    _flag(g, "--decode-metrics", "scrape: static decode metrics addresses host:port[,...]", default="")
    _flag(g, "--interval", "seconds between planning rounds", default=15.0, type=float)
    _flag(g, "--window", "seconds over which rates and latency quantiles are taken", default=60.0, type=float)
    g = p.add_argument_group("targets (capacity: tokens/s one replica sustains; 0 = unknown, scale on latency)")
    for role, latency, default, capacity in (("prefill", "ttft", 1.0, "prompt tokens/s"),
                                             ("decode", "itl", 0.05, "generated tokens/s at the ITL target")):
        _flag(g, f"--{role}-min-replicas", f"fewest {role} replicas", default=1, type=int)
        _flag(g, f"--{role}-max-replicas", f"most {role} replicas", default=8, type=int)
        _flag(g, f"--{role}-target-{latency}", f"{latency.upper()} p90 target, seconds", default=default, type=float)
        _flag(g, f"--{role}-capacity", f"{capacity} per {role} replica", default=0.0, type=float)
        _flag(g, f"--{role}-utilization", f"fraction of {role} capacity to plan for", default=0.7, type=float)
    _flag(g, "--decode-kv-cache-usage-target", "mean decode KV cache usage to stay under (0: off)", default=0.8,
          type=float)
    g = p.add_argument_group("stability")
    _flag(g, "--tolerance", "scale down only with this fraction of capacity to spare", default=0.1, type=float)
    _flag(g, "--scale-up-cooldown", "seconds after a change before a role may grow", default=30.0, type=float)
    _flag(g, "--scale-down-cooldown", "seconds after a change before a role may shrink", default=120.0, type=float)
    _flag(g, "--scale-down-window", "shrink only to the highest count recommended over these seconds",
          default=300.0, type=float)
    _flag(g, "--scale-down-step", "most replicas removed per round", default=1, type=int)
    g = p.add_argument_group("SLA mode (both pools sized by simulating the observed load on a profile)")
    _flag(g, "--mode", "feedback: capacity, KV usage and latency per role; sla: the simulator, from the "
          "observed request rate and lengths, corrected by measured/predicted latency", default="feedback",
          choices=["feedback", "sla"])
    _flag(g, "--profile", "sla: a profile file from `pdserve profile`")
    _flag(g, "--slo", "sla: ttft:MS,tpot:MS")
    _flag(g, "--sla-attainment", "sla: fraction of requests that must meet the SLOs", default=0.9, type=float)
    _flag(g, "--kv-transport", "sla: the KV transport the deployment uses (its profile entry)", default="tcp")
    g = p.add_argument_group("process")
    _flag(g, "--dry-run", "only log and export decisions, never scale", action="store_true")
    _flag(g, "--host", "address of the planner's own /metrics", default="0.0.0.0")
    _flag(g, "--metrics-port", "port of the planner's own /metrics (0: off)", default=0, type=int)
    _flag(g, "--once", "one planning round, then exit", action="store_true")
    p.set_defaults(func=run_planner)
    return p


def config_from_args(args) -> PlannerConfig:
    deployments = {"prefill": args.prefill_deployment, "decode": args.decode_deployment}
    roles = tuple(r for r in ROLES if deployments[r]) or (ROLES if args.dry_run else ())
    if not roles:
        raise ValueError("nothing to scale: give --prefill-deployment and/or --decode-deployment (or --dry-run)")
    return PlannerConfig(
        prefill=RoleTargets(args.prefill_min_replicas, args.prefill_max_replicas, args.prefill_target_ttft,
                            args.prefill_capacity, args.prefill_utilization),
        decode=RoleTargets(args.decode_min_replicas, args.decode_max_replicas, args.decode_target_itl,
                           args.decode_capacity, args.decode_utilization, args.decode_kv_cache_usage_target),
        stability=Stability(args.tolerance, args.scale_up_cooldown, args.scale_down_cooldown, args.scale_down_window,
                            args.scale_down_step),
        roles=roles, interval_s=args.interval, window_s=args.window, dry_run=args.dry_run,
        sla=_sla_targets(args))


def _sla_targets(args) -> SlaTargets | None:
    if getattr(args, "mode", "feedback") != "sla":
        return None
    if not args.profile or not args.slo:
        raise ValueError("--mode sla needs --profile FILE and --slo ttft:MS,tpot:MS")
    from services.planner.sim_metrics import parse_slo

    slos = parse_slo(args.slo)
    if set(slos) != {"ttft", "tpot"}:
        raise ValueError("--slo needs both ttft:MS and tpot:MS in SLA mode")
    return SlaTargets(slos["ttft"], slos["tpot"], args.sla_attainment, args.kv_transport)


def build_planner(args):
    """-> Planner, from parsed flags (Kubernetes is contacted only when something needs it)."""
    from services.planner import k8s
    from services.planner.planner import Planner

    config = config_from_args(args)
    deployments = {r: getattr(args, f"{r}_deployment") for r in config.roles if getattr(args, f"{r}_deployment")}
    services = {r: getattr(args, f"{r}_service") for r in ROLES}
    api = None
    if deployments or any(services.values()):
        api = k8s.api_client(args.kubeconfig, args.kube_api_url)
    namespace = args.namespace or k8s.in_cluster_namespace()
    if args.metrics_source == "prometheus":
        if not args.prometheus_url:
            raise ValueError("--metrics-source prometheus needs --prometheus-url (or use --metrics-source scrape)")
        from services.planner.prometheus import PrometheusSource

        source = PrometheusSource(args.prometheus_url, config.window_s, args.prometheus_selector)
    else:
        from services.planner.scrape import ScrapeSource

        static = {r: _addresses(getattr(args, f"{r}_metrics")) for r in ROLES}

        def targets(role: str) -> list[str]:
            if services[role]:
                return k8s.endpointslice_addresses(api, namespace, services[role], args.metrics_port_name)
            return static[role]

        missing = [r for r in config.roles if not services[r] and not static[r]]
        if missing:
            raise ValueError(f"--metrics-source scrape needs --{missing[0]}-service or --{missing[0]}-metrics")
        source = ScrapeSource(targets, config.window_s)
    scaler = k8s.DeploymentScaler(api, namespace, deployments) if deployments else None
    sla = None
    if config.sla is not None:
        from services.planner.profile_data import Profile
        from services.planner.sla import SlaSizer

        sla = SlaSizer(Profile.load(args.profile), config.sla, config.prefill.max_replicas, config.decode.max_replicas)
    return Planner(config, source, scaler, sla=sla)


def run_planner(args) -> int:
    planner = build_planner(args)
    if args.metrics_port:
        planner.metrics.serve(args.host, args.metrics_port)
        logger.info("planner metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    if args.once:
        planner.step()
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    planner.run(stop)
    return 0
