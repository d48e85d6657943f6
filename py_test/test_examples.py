"""The ops examples agree with the server they deploy: ports, probes, grace periods, and
dashboard queries that name series the server really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_router.cli import build_parser, vllm_available
from vllm_router.contracts.vllm_grpc_engine.servicer import SERVICE_NAME as VLLM_GRPC_SERVICE
from vllm_router.core import ServicerMetrics
from vllm_router.dataclass_flags import from_args
from vllm_router.server import ServerConfig
from vllm_router.server.health_service import LIVENESS
from vllm_router.vllm_servicer import SERVICE_NAME

from harness import require

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Health service names the server publishes on grpc.health.v1 ("" = the whole server).
PUBLISHED = {"", SERVICE_NAME, VLLM_GRPC_SERVICE, LIVENESS}


@pytest.fixture(scope="module")
def manifests() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((EXAMPLES / "kubernetes" / "worker.yaml").read_text()))
    return {doc["kind"]: doc for doc in docs}


def _container(manifests: dict[str, Any]) -> dict[str, Any]:
    [container] = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _config(container: dict[str, Any]) -> ServerConfig:
    require(vllm_available(), "vLLM is not installed (make test)")
    args = build_parser(with_vllm=True).parse_args(container["args"])
    return from_args(ServerConfig, args)


def test_ports_agree_with_the_server(manifests: dict[str, Any]) -> None:
    container = _container(manifests)
    config = _config(container)
    assert config.port == ServerConfig().port  # the default port, spelled out
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port}
    annotations = manifests["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert config.host == "0.0.0.0"  # reachable from the kubelet and the Service
    service_ports = {p["name"]: p for p in manifests["Service"]["spec"]["ports"]}
    assert service_ports["grpc"]["port"] == config.port
    assert {p["targetPort"] for p in service_ports.values()} <= set(ports)


def test_probes_ask_grpc_health_for_published_services(manifests: dict[str, Any]) -> None:
    container = _container(manifests)
    config = _config(container)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = container[probe]["grpc"]
        assert grpc_probe["port"] == config.port, probe
        assert grpc_probe.get("service", "") in PUBLISHED, probe
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_grace_periods_leave_room_for_the_drain(manifests: dict[str, Any]) -> None:
    container = _container(manifests)
    config = _config(container)
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    engine_shutdown_margin = 10
    assert config.shutdown_grace_seconds == ServerConfig().shutdown_grace_seconds
    assert pod["terminationGracePeriodSeconds"] >= (
        pause + config.shutdown_grace_seconds + engine_shutdown_margin
    )
    # A drain reports NOT_SERVING; liveness must not restart the worker during one.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > config.shutdown_grace_seconds


def test_probes_follow_the_stall_stages(manifests: dict[str, Any]) -> None:
    """Readiness leaves at the first stall limit (NOT_SERVING on its service name, within a
    probe). Liveness asks the name that stays SERVING while the process serves at all
    (test_engine_progress.py shows it through a stall): what the worker decides itself, at
    --engine-stall-exit-seconds whatever its value (0 included), liveness never pre-empts,
    and a process that answers nothing is restarted within a few periods."""
    container = _container(manifests)
    config = _config(container)
    first, second = config.engine_stall_timeout_seconds, config.engine_stall_exit_seconds
    assert 0 < first < second
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["failureThreshold"] * readiness["periodSeconds"] <= 10
    assert liveness["grpc"]["service"] == LIVENESS
    assert liveness["failureThreshold"] * liveness["periodSeconds"] <= 120


def test_dashboard_queries_name_exported_series() -> None:
    dashboard = json.loads((EXAMPLES / "grafana" / "vllm-servicer.json").read_text())
    families = list(ServicerMetrics().registry.collect())
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    exported = {f.name + suffix for f in families for suffix in suffixes[f.type]}
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    used = set()
    for panel in panels:
        for target in panel["targets"]:
            used |= set(re.findall(r"vllm_servicer:[a-z_]+", target["expr"]))
    assert used, "the dashboard queries no vllm_servicer series"
    assert used <= exported, used - exported
    # Every series has a panel.
    assert {f.name for f in families} <= {re.sub(r"_(total|bucket)$", "", n) for n in used}
