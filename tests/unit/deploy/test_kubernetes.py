"""deploy/kubernetes: every overlay renders under `kubectl kustomize`, and what it renders
holds together: probes, resources and a locked-down security context on every container,
selectors that select something, files the containers name inside their mounts, the
kustomized images, and environment variables the programs really read.

Without kubectl the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpd_agent.__main__ import AgentSettings
from hpd_common.redis_conn import parse_url
from hpd_gateway.__main__ import GatewaySettings
from hpd_kvbroker.settings import KvBrokerSettings
from hpd_registry.settings import RegistrySettings
from hpd_scheduler.settings import SchedulerSettings
from hpd_tools.tlsgen import ROLES
from tests.unit.deploy.promql_names import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
IMAGE_USER = 10001
TLS_SECRET = "hetero-pd-tls"
# the files `hpd certs DIR --host ...` writes, which the Secret is made from
TLS_FILES = {"ca.pem", "server.pem", "server.key", "client.pem", "client.key", "tokens.yaml"}
TLS_FILES |= {f"role-{role}.{ext}" for role in ROLES for ext in ("pem", "key")}
# what each hetero-pd command reads from HPD_<NAME>; the image's gRPC health probe reads
# HPD_CA_FILE, HPD_CERT_FILE and HPD_KEY_FILE beside any service
PROBE_ENV = {"HPD_CA_FILE", "HPD_CERT_FILE", "HPD_KEY_FILE"}
SETTINGS: dict[str, type[Any]] = {
    "registry": RegistrySettings,
    "scheduler": SchedulerSettings,
    "kvbroker": KvBrokerSettings,
    "gateway": GatewaySettings,
    "agent": AgentSettings,
}
GRPC_SERVICES = ("registry", "scheduler", "kvbroker")

Doc = dict[str, Any]


def kubectl() -> str:
    """kubectl on PATH; a failure under CI=true, else a skip."""
    found = shutil.which("kubectl")
    if found is None:
        reason = "kubectl is not on PATH: the Kubernetes manifests cannot be rendered"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@functools.cache
def render(overlay: str) -> tuple[Doc, ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(KUBE / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"kubectl kustomize overlays/{overlay}:\n{done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def of_kind(docs: tuple[Doc, ...], *kinds: str) -> list[Doc]:
    return [d for d in docs if d["kind"] in kinds]


def workloads(docs: tuple[Doc, ...]) -> list[Doc]:
    return of_kind(docs, *WORKLOADS)


def name(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


def containers(workload: Doc, init: bool = True) -> Iterator[Doc]:
    spec = pod_spec(workload)
    yield from spec["containers"]
    if init:
        yield from spec.get("initContainers", [])


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions, or a Service's plain
    map) matches ``labels``; an empty selector matches everything."""
    if not selector:
        return True
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def selected(docs: tuple[Doc, ...], selector: Mapping[str, Any] | None) -> list[Doc]:
    return [w for w in workloads(docs) if selects(selector, pod_labels(w))]


def port_names(workload: Doc) -> set[str]:
    return {p["name"] for c in containers(workload) for p in c.get("ports", []) if "name" in p}


def kustomize_images(folder: Path) -> set[str]:
    """name:tag of every `images:` entry of a kustomization and those it builds on."""
    doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
    out = {f"{i.get('newName', i['name'])}:{i['newTag']}" for i in doc.get("images", [])}
    for resource in doc.get("resources", []):
        if (folder / resource / "kustomization.yaml").is_file():
            out |= kustomize_images((folder / resource).resolve())
    return out


def hpd_command(container: Doc) -> str:
    """`registry` for a container running `hpd registry`, "" for anything else."""
    command = container.get("command", [])
    return str(command[1]) if len(command) >= 2 and command[0] == "hpd" else ""


def env(container: Doc) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


@pytest.fixture(params=OVERLAYS)
def docs(request: pytest.FixtureRequest) -> tuple[Doc, ...]:
    return render(str(request.param))


def test_there_are_overlays_to_render() -> None:
    assert {"default", "vllm-pool"} <= set(OVERLAYS)


def test_every_overlay_runs_the_whole_control_plane(docs: tuple[Doc, ...]) -> None:
    commands = {hpd_command(c) for w in workloads(docs) for c in containers(w)}
    assert {"registry", "scheduler", "kvbroker", "gateway"} <= commands
    kinds = {d["kind"] for d in docs}
    assert {"PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "StatefulSet"} <= kinds


def test_every_container_has_probes_and_resources(docs: tuple[Doc, ...]) -> None:
    """Containers: readiness and liveness probes. Init containers run to completion first
    (Kubernetes refuses probes on them unless they are sidecars, restartPolicy Always),
    so only those sidecars need probes. Every one: requests and limits of CPU and memory."""
    problems = []
    for w in workloads(docs):
        main = {c["name"] for c in pod_spec(w)["containers"]}
        for c in containers(w):
            where = f"{name(w)} container {c['name']}"
            if c["name"] in main or c.get("restartPolicy") == "Always":
                problems += [
                    f"{where}: no {p}" for p in ("readinessProbe", "livenessProbe") if p not in c
                ]
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(res.get(part, {}))
                if missing:
                    problems.append(f"{where}: no {part} of {sorted(missing)}")
    assert not problems, "\n".join(problems)


def _security_problems(w: Doc) -> list[str]:
    spec = pod_spec(w)
    pod = spec.get("securityContext", {})
    out = []
    if pod.get("runAsNonRoot") is not True:
        out.append(f"{name(w)}: the pod is not runAsNonRoot")
    if pod.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        out.append(f"{name(w)}: no RuntimeDefault seccomp profile")
    for c in containers(w):
        sc = c.get("securityContext", {})
        where = f"{name(w)} container {c['name']}"
        user = sc.get("runAsUser", pod.get("runAsUser"))
        if not user:
            out.append(f"{where}: runs as root or an unknown user")
        elif c["image"].split(":")[0].endswith("hetero-pd") and user != IMAGE_USER:
            out.append(f"{where}: not the image's user {IMAGE_USER}")
        if sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            out.append(f"{where}: not runAsNonRoot")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{where}: the root filesystem is writable")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: privilege escalation is allowed")
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            out.append(f"{where}: capabilities are not all dropped")
    return out


def test_every_pod_runs_locked_down(docs: tuple[Doc, ...]) -> None:
    problems = [p for w in workloads(docs) for p in _security_problems(w)]
    assert not problems, "\n".join(problems)


def test_every_service_selects_a_pod_with_its_ports(docs: tuple[Doc, ...]) -> None:
    problems = []
    for svc in of_kind(docs, "Service"):
        pods = selected(docs, svc["spec"].get("selector"))
        if not svc["spec"].get("selector") or not pods:
            problems.append(f"{name(svc)}: selects no pod template")
            continue
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str) and not any(target in port_names(w) for w in pods):
                problems.append(f"{name(svc)}: no selected pod has a port named {target}")
    assert not problems, "\n".join(problems)


def test_every_disruption_budget_covers_a_workload(docs: tuple[Doc, ...]) -> None:
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        selector = pdb["spec"].get("selector")
        assert selector, f"{name(pdb)}: no selector (it would cover every pod)"
        assert selected(docs, selector), f"{name(pdb)}: covers no workload"


def test_every_network_policy_selects_pods_and_peers(docs: tuple[Doc, ...]) -> None:
    """Each policy selects pods; each in-namespace peer selector matches a pod; each named
    port is a port of a selected pod."""
    problems = []
    for pol in of_kind(docs, "NetworkPolicy"):
        targets = selected(docs, pol["spec"]["podSelector"])
        if not pol["spec"]["podSelector"] or not targets:
            problems.append(f"{name(pol)}: selects no pod")
        for rule in pol["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                local = "podSelector" in peer and "namespaceSelector" not in peer
                if local and not selected(docs, peer["podSelector"]):
                    problems.append(f"{name(pol)}: peer {peer['podSelector']} is no pod")
            for port in rule.get("ports", []):
                p = port.get("port")
                if isinstance(p, str) and not any(p in port_names(w) for w in targets):
                    problems.append(f"{name(pol)}: no selected pod has a port named {p}")
    assert not problems, "\n".join(problems)


def test_every_service_monitor_scrapes_a_named_metrics_port(docs: tuple[Doc, ...]) -> None:
    monitors = of_kind(docs, "ServiceMonitor")
    assert monitors
    services = of_kind(docs, "Service")
    for mon in monitors:
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        chosen = [s for s in services if selects(mon["spec"]["selector"], s["metadata"]["labels"])]
        assert chosen, f"{name(mon)}: selects no Service"
        for endpoint in mon["spec"]["endpoints"]:
            ports = {p.get("name") for s in chosen for p in s["spec"]["ports"]}
            assert endpoint["port"] in ports, f"{name(mon)}: no Service port {endpoint['port']}"
    # the control plane's own metrics ports are all scraped
    scraped = {
        (s["metadata"]["name"], p["port"])
        for mon in monitors
        for s in services
        if selects(mon["spec"]["selector"], s["metadata"]["labels"])
        for p in s["spec"]["ports"]
        if p.get("name") in {e["port"] for e in mon["spec"]["endpoints"]}
    }
    for svc, port in [("registry", 9101), ("scheduler", 9102), ("kvbroker", 9103)]:
        assert (svc, port) in scraped, f"{svc}'s metrics port {port} is not scraped"


def _mount_problems(w: Doc) -> list[str]:
    volumes = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
    out = []
    for c in containers(w):
        mounts = c.get("volumeMounts", [])
        for var, value in env(c).items():
            if not value.startswith("/"):
                continue
            where = f"{name(w)} container {c['name']} {var}={value}"
            inside = [m for m in mounts if under(value, m["mountPath"])]
            if not inside:
                out.append(f"{where}: not under any of its mounts")
                continue
            secret = volumes.get(inside[0]["name"], {}).get("secret", {})
            rel = value[len(inside[0]["mountPath"]) :].lstrip("/")
            if secret.get("secretName") == TLS_SECRET and rel not in TLS_FILES:
                out.append(f"{where}: `hpd certs` writes no {rel}")
        out += [
            f"{name(w)} container {c['name']}: mounts unknown volume {m['name']}"
            for m in mounts
            if m["name"] not in volumes and not _claim_template(w, m["name"])
        ]
    return out


def _claim_template(w: Doc, volume: str) -> bool:
    claims = w["spec"].get("volumeClaimTemplates", [])
    return any(t["metadata"]["name"] == volume for t in claims)


def test_every_file_a_container_names_is_in_its_mounts(docs: tuple[Doc, ...]) -> None:
    problems = [p for w in workloads(docs) for p in _mount_problems(w)]
    assert not problems, "\n".join(problems)


def test_every_image_is_a_kustomized_one(docs: tuple[Doc, ...], request: Any) -> None:
    overlay = request.node.callspec.params["docs"]
    allowed = kustomize_images(KUBE / "overlays" / overlay)
    assert "hetero-pd:0.1.0" in allowed
    for w in workloads(docs):
        for c in containers(w):
            assert c["image"] in allowed, f"{name(w)} {c['name']}: image {c['image']}"
            if hpd_command(c) or "redis" in " ".join(c.get("command", [])):
                assert c["image"] == "hetero-pd:0.1.0", f"{name(w)} {c['name']}: not hetero-pd"


def test_every_setting_is_one_the_program_reads(docs: tuple[Doc, ...]) -> None:
    """HPD_<NAME> variables are fields of the command's settings (a misspelt one would be
    ignored silently); the services set every variable compose.yaml gives them."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for w in workloads(docs):
        for c in containers(w):
            command = hpd_command(c)
            if not command:
                continue
            fields = {"HPD_" + f.name.upper() for f in dataclasses.fields(SETTINGS[command])}
            given = {k for k in env(c) if k.startswith("HPD_")}
            unknown = given - fields - (PROBE_ENV if command in GRPC_SERVICES else set())
            assert not unknown, f"{name(w)} hpd {command}: no such settings {sorted(unknown)}"
            if command in GRPC_SERVICES:
                want = {k for k, v in compose["services"][command]["environment"].items() if v}
                want -= {"HPD_SCHEDULER_TOKEN", "HPD_BROKER_TOKEN"}  # older clients' tokens
                assert want <= given, f"hpd {command}: not set {sorted(want - given)}"


def test_the_services_find_redis_through_the_sentinels(docs: tuple[Doc, ...]) -> None:
    sentinels = {
        f"{s['metadata']['name']}-{i}.{s['spec']['serviceName']}"
        for s in of_kind(docs, "StatefulSet")
        if "26379" in str(s["spec"]["template"]["spec"]["containers"][0].get("ports"))
        for i in range(s["spec"]["replicas"])
    }
    assert len(sentinels) >= 3
    for w in workloads(docs):
        for c in containers(w):
            if hpd_command(c) in GRPC_SERVICES:
                target = parse_url(env(c)["HPD_REDIS_URL"])
                assert target.service and target.wait_replicas >= 1
                assert {h for h, _ in target.sentinels} == sentinels
    scripts = " ".join(str(d.get("data", "")) for d in of_kind(docs, "ConfigMap"))
    for line in ("appendonly yes", "maxmemory 1gb", "maxmemory-policy noeviction"):
        assert line in scripts, f"Redis runs without {line!r}"
