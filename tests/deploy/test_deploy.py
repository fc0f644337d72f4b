"""deploy/: the Kubernetes manifests validate offline against the Kubernetes API schemas (kubernetes-validate,
strict: an unknown field fails), refer to each other consistently, and run `strata` command lines that Strata's own
argument parser accepts; the Grafana dashboard queries only series that Strata exports. No cluster, no network."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvbm.metrics import KVBMMetrics
from server import cli
from server.openai.metrics import FrontendMetrics
from server.planner.metrics import PlannerMetrics
from server.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "strata-dashboard.json"
KUSTOMIZATION = "kustomization.yaml"
IMAGE = "strata:latest"
# The newest Kubernetes release whose schemas kubernetes-validate bundles (1.37.0 with kubernetes-validate 1.37).
K8S_VERSION = kubernetes_validate.latest_version()
# Objects the pods refer to that the operator creates (docs/kubernetes.md); deploy/kubernetes does not ship them.
OPERATOR_CREATED = {
    ("ConfigMap", "strata-profile"),  # `strata profile --output profile.json` run on the worker hardware
}
WORKER_DEPLOYMENTS = {"strata-prefill": "prefill", "strata-decode": "decode"}


# ---------------------------------------------------------------------------------------------------- loading


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.iterdir() if p.suffix in (".yaml", ".yml") and p.name != KUSTOMIZATION)


@functools.cache
def objects() -> tuple[tuple[str, dict], ...]:
    """(file name, object) of every document of every manifest."""
    found = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return tuple(found)


def of_kind(kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for _, obj in objects() if obj["kind"] == kind}


def pod_specs() -> Iterator[tuple[str, dict]]:
    for name, deployment in of_kind("Deployment").items():
        yield name, deployment["spec"]["template"]["spec"]


def strata_containers() -> Iterator[tuple[str, dict]]:
    """(Deployment name, container) of every container that runs `strata`."""
    for name, spec in pod_specs():
        for container in spec["containers"]:
            if container.get("image") == IMAGE:
                yield name, container


def argv(container: dict) -> list[str]:
    """The container's `strata` arguments with $(VAR) expanded as the kubelet would, from sample values."""
    sample = {"POD_IP": "10.1.2.3", "POD_NAME": "strata-decode-5d9f-abcde", "POD_NAMESPACE": "strata"}
    defined = {env["name"] for env in container.get("env", [])}
    args = []
    for arg in container["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in defined, f"{container['name']}: $({var}) in its args is not in its env"
            arg = arg.replace(f"$({var})", sample[var])
        args.append(arg)
    return args


def flag(args: list[str], name: str) -> list[str]:
    """Every value given to `name` in `args`."""
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]


def container_ports(spec: dict) -> dict[str | int, int]:
    """Port names and numbers (each mapped to the number) the pod's containers declare."""
    ports: dict[str | int, int] = {}
    for container in spec["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


# ---------------------------------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_manifest_validates_strictly_against_the_kubernetes_schemas(path: Path) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        where = f"{path.name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        error = None
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            error = f"{where} (Kubernetes {K8S_VERSION}): {exc.message} at {list(exc.absolute_path)}"
        if error:
            pytest.fail(error)
        assert "namespace" not in doc["metadata"], (
            f"{where}: names a namespace (kubectl -n / kustomize set it)"
        )


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The check above is strict: a misspelt field fails it (as `kubectl apply --validate=strict` would)."""
    _, deployment = next((f, o) for f, o in objects() if o["kind"] == "Deployment")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "IfNotPresent"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest_and_nothing_else() -> None:
    kustomization = yaml.safe_load((K8S / KUSTOMIZATION).read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), f"listed twice: {resources}"
    assert sorted(resources) == [p.name for p in manifest_files()]
    assert "namespace" not in kustomization, (
        "namespace-agnostic: kubectl -n, or the operator's overlay, sets it"
    )


# ---------------------------------------------------------------------------------------------------- references


def test_deployments_select_their_own_pods_and_services_select_a_deployment() -> None:
    pods = {}
    for name, deployment in of_kind("Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), f"Deployment {name}: selector {selector} misses its pods"
        pods[name] = (labels, deployment["spec"]["template"]["spec"])
    for name, service in of_kind("Service").items():
        selector = service["spec"]["selector"]
        matched = [d for d, (labels, _) in pods.items() if selector.items() <= labels.items()]
        assert len(matched) == 1, f"Service {name}: selector {selector} matches Deployments {matched}"
        ports = container_ports(pods[matched[0]][1])
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in ports, f"Service {name}: targetPort {target!r} is no port of {matched[0]}'s pods"


def test_rbac_binds_the_role_to_the_service_account_the_planner_runs_as() -> None:
    roles, accounts = of_kind("Role"), of_kind("ServiceAccount")
    bindings = of_kind("RoleBinding")
    assert bindings
    for name, binding in bindings.items():
        assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] in roles, name
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts, (name, subject)
    bound = {s["name"] for b in bindings.values() for s in b["subjects"]}
    for name, spec in pod_specs():
        account = spec.get("serviceAccountName")
        if account is not None:
            assert account in accounts and account in bound, f"{name}: service account {account} unbound"
    # the planner may read and scale the worker Deployments (and no other), and hold its Lease
    rules = [rule for role in roles.values() for rule in role["rules"]]

    def allowed(group: str, resource: str, verb: str, name: str | None = None) -> bool:
        return any(
            group in r["apiGroups"]
            and resource in r["resources"]
            and verb in r["verbs"]
            and (name is None or "resourceNames" not in r or name in r["resourceNames"])
            for r in rules
        )

    for deployment in WORKER_DEPLOYMENTS:
        assert allowed("apps", "deployments", "get", deployment)
        for verb in ("get", "patch", "update"):
            assert allowed("apps", "deployments/scale", verb, deployment)
    for verb in ("get", "create", "update"):
        assert allowed("coordination.k8s.io", "leases", verb)
    deployments = of_kind("Deployment")
    for rule in rules:
        for resource_name in rule.get("resourceNames", []):
            assert resource_name in deployments, f"Role names {resource_name}, which is no Deployment here"


def test_config_maps_and_secrets_the_pods_use_exist_or_are_the_operators() -> None:
    defined = {(kind, name) for kind in ("ConfigMap", "Secret") for name in of_kind(kind)}
    secrets = of_kind("Secret")
    used = set()
    for name, spec in pod_specs():
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                used.add(("ConfigMap", volume["configMap"]["name"]))
            if "secret" in volume:
                used.add(("Secret", volume["secret"]["secretName"]))
        for container in spec["containers"]:
            for env in container.get("env", []):
                source = env.get("valueFrom", {})
                if "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    used.add(("Secret", ref["name"]))
                    if ref["name"] in secrets:
                        keys = {
                            **secrets[ref["name"]].get("data", {}),
                            **secrets[ref["name"]].get("stringData", {}),
                        }
                        assert ref["key"] in keys, f"{name}: Secret {ref['name']} has no key {ref['key']}"
                if "configMapKeyRef" in source:
                    used.add(("ConfigMap", source["configMapKeyRef"]["name"]))
            for env_from in container.get("envFrom", []):
                for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if key in env_from:
                        used.add((kind, env_from[key]["name"]))
    assert used - defined <= OPERATOR_CREATED, f"used, neither shipped nor operator-created: {used - defined}"
    assert OPERATOR_CREATED <= used, f"documented as operator-created but unused: {OPERATOR_CREATED - used}"
    assert not OPERATOR_CREATED & defined, "an operator-created object is shipped as well"


def test_every_url_in_the_commands_names_a_service_and_its_port() -> None:
    services = of_kind("Service")
    urls = 0
    for name, container in strata_containers():
        for arg in argv(container):
            match = re.fullmatch(r"(?:redis|rediss|http|https)://([a-z0-9-]+):(\d+)(/.*)?", arg)
            if match is None:
                continue
            urls += 1
            host, port = match.group(1), int(match.group(2))
            assert host in services, f"{name}: {arg} names no Service"
            assert port in {p["port"] for p in services[host]["spec"]["ports"]}, (
                f"{name}: {arg}: no such port"
            )
    assert urls >= 4  # frontend and workers: Redis; planner: the frontend's metrics and disagg API


def test_probe_and_scrape_ports_are_ports_the_containers_declare() -> None:
    for name, deployment in of_kind("Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        ports = container_ports(spec)
        for container in spec["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                for handler in ("httpGet", "tcpSocket"):
                    port = container.get(probe, {}).get(handler, {}).get("port")
                    if port is not None:
                        assert port in ports, f"{name}: {probe} on port {port!r}, which it does not declare"
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            assert int(annotations["prometheus.io/port"]) in ports.values(), name
            assert annotations["prometheus.io/path"] == "/metrics", name


# ---------------------------------------------------------------------------------------------------- the image


def test_strata_containers_run_what_the_dockerfile_builds() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR\s+(\S+)", dockerfile, re.M).group(1)
    assert re.search(r"^COPY\s+model_repository\s+model_repository", dockerfile, re.M) or re.search(
        r"^COPY\s+\.\s+\.", dockerfile, re.M
    ), "the image holds the model repository"
    assert re.search(r"^RUN\s+make install", dockerfile, re.M), "the image installs Strata into .venv"
    containers = list(strata_containers())
    assert {name for name, _ in containers} >= {"strata-frontend", *WORKER_DEPLOYMENTS, "strata-planner"}
    for name, container in containers:
        assert container["command"] == [f"{workdir}/.venv/bin/strata"], name
        for repository in flag(container["args"], "--model-repository"):
            assert repository == f"{workdir}/model_repository", name


# ---------------------------------------------------------------------------------------------------- command lines


def strata_parser() -> argparse.ArgumentParser:
    return cli.build_parser()


def subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {
        choice
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for choice in action.choices
    }


def parse(parser: argparse.ArgumentParser, args: list[str], where: str) -> argparse.Namespace:
    """Strata's own parse of `args`; a parse error (argparse exits 2) fails with argparse's message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(args)
    except SystemExit:
        pass
    pytest.fail(f"{where}: strata {' '.join(args)}\n{stderr.getvalue()}")


def llm_models() -> set[str]:
    return {
        path.parent.name
        for path in (ROOT / "model_repository").glob("*/config.pbtxt")
        if re.search(r'^backend:\s*"(strata_llm|vllm)"', path.read_text(), re.M)
    }


def test_every_strata_command_line_is_accepted_by_strata_s_parser() -> None:
    parser = strata_parser()
    commands = subcommands(parser)
    assert {"serve", "worker", "planner"} <= commands
    parsed: dict[str, list[str]] = {}
    for name, container in strata_containers():
        args = argv(container)
        assert args[0] in commands, f"{name}: unknown strata subcommand {args[0]!r}"
        parse(parser, args, name)
        parsed.setdefault(args[0], []).append(name)
    assert len(parsed.get("serve", [])) == 1
    assert sorted(parsed.get("worker", [])) == sorted(WORKER_DEPLOYMENTS)
    assert parsed.get("planner") == ["strata-planner"]


def test_the_frontend_serves_the_llm_disaggregated_by_remote_workers_only() -> None:
    (name, container), *others = [(n, c) for n, c in strata_containers() if c["args"][0] == "serve"]
    assert not others
    args = parse(strata_parser(), argv(container), name)
    # checked by `strata serve` at start (server/serve.py llm_serving), repeated here without importing torch
    assert args.accept_remote_workers and args.redis_url
    assert args.workers is None, "--workers serves the LLM aggregated, and prefill workers are then refused"
    assert (args.prefill_workers, args.decode_workers) == (0, 0)  # every worker is a remote pod
    assert args.kvbm_flush_secs <= args.exit_timeout_secs
    pod = of_kind("Deployment")[name]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > args.exit_timeout_secs
    envs = {env["name"] for env in container["env"]}
    assert "STRATA_CLUSTER_SECRET" in envs  # --accept-remote-workers refuses to start without it
    probes = {p: container[p]["httpGet"] for p in ("readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    ports = container_ports(pod)
    assert all(ports[p["port"]] == args.http_port for p in probes.values())
    assert {args.http_port, args.grpc_port, args.metrics_port, args.openai_port} <= set(ports.values())
    startup = container["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= 300, f"startupProbe gives Triton and the repository only {budget} s to come up"


def test_workers_advertise_their_pod_ip_and_drain_within_the_grace_period() -> None:
    parser = strata_parser()
    deployments = of_kind("Deployment")
    for name, role in WORKER_DEPLOYMENTS.items():
        pod = deployments[name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = parse(parser, argv(container), name)
        assert args.role == role
        assert args.model in llm_models(), f"{name}: --model {args.model} is no LLM of model_repository/"
        env = {
            e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]
        }
        assert flag(container["args"], "--advertise-host") == ["$(POD_IP)"]
        assert env["POD_IP"] == "status.podIP"
        assert flag(container["args"], "--worker-id") == ["$(POD_NAME)"]
        assert env["POD_NAME"] == "metadata.name"
        assert "STRATA_CLUSTER_SECRET" in env
        # SIGTERM: drain for --exit-timeout-secs, then the G2 -> G3 copy; the kubelet's SIGKILL must come later
        assert pod["terminationGracePeriodSeconds"] > args.exit_timeout_secs + args.kvbm_flush_secs
        ports = container_ports(pod)
        assert {args.port, args.port + 1, args.kv_transfer_port} <= set(ports.values())
        # the planner owns the replica count: a count here would be written back by every apply
        assert "replicas" not in deployments[name]["spec"]
        assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["cpu"]


def test_the_planner_scales_the_worker_deployments_and_reads_its_profile_from_the_config_map() -> None:
    deployment = of_kind("Deployment")["strata-planner"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "planner"
    assert dict(value.split("=", 1) for value in flag(args, "--deployment")) == {
        role: name for name, role in WORKER_DEPLOYMENTS.items()
    }
    assert set(flag(args, "--model")) <= llm_models() and flag(args, "--model")
    (profile,) = flag(args, "--profile")
    (mount,) = [m for m in container["volumeMounts"] if profile.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "strata-profile"
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name"  # its identity on the Lease
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == flag(args, "--metrics-port")[0]


# ---------------------------------------------------------------------------------------------------- dashboard

SERIES = re.compile(r"\b(?:strata|kvbm)_[a-z0-9_]+")  # Strata's own series; the KVBM's are named kvbm_*
METRIC_CONSTRUCTOR = re.compile(
    r"\b(?:Counter|Gauge|Histogram|Summary|Info|Enum)\(\s*\"([a-zA-Z_:][a-zA-Z0-9_:]*)\""
)
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


@functools.cache
def families() -> dict[str, str]:
    """Name -> type of every metric family Strata's metrics classes register (the frontend's /metrics holds the
    first three, the planner's port the last)."""
    registry = CollectorRegistry()
    FrontendMetrics.create(registry)
    RouterMetrics.create(registry)
    KVBMMetrics(registry)
    PlannerMetrics.create(registry)
    return {family.name: family.type for family in registry.collect()}


@functools.cache
def exported() -> frozenset[str]:
    """Every sample name of those families (a counter `x`: x_total and x_created; a histogram: _bucket, _sum,
    _count, _created; a gauge: its name)."""
    names = set()
    for name, kind in families().items():
        assert kind in SUFFIXES, f"{name}: metric type {kind} not expanded here"
        names.update(name + suffix for suffix in SUFFIXES[kind])
    return frozenset(names)


def test_the_exported_set_covers_every_metric_strata_defines() -> None:
    """The classes instantiated above are all there are: every metric constructed in server/ or kvbm/ is in it."""
    defined = {
        name.removesuffix("_total")  # prometheus_client names a counter's family without it
        for path in [*ROOT.joinpath("server").rglob("*.py"), *ROOT.joinpath("kvbm").rglob("*.py")]
        for name in METRIC_CONSTRUCTOR.findall(path.read_text())
    }
    assert len(defined) > 40, f"only {sorted(defined)} found: the constructor pattern is out of date"
    assert defined <= families().keys(), (
        f"defined but not in the exported set: {sorted(defined - families().keys())}"
    )


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> Iterator[dict]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def test_dashboard_is_valid_json_with_a_templated_datasource_and_model() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["title"] and board["uid"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    model = variables["model"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${datasource}"
    assert model["query"]["query"] == "label_values(strata_requests_total, model)"
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    titles = {panel["title"] for panel in panels(board) if panel["type"] == "row"}
    for row in ("LLM", "Router", "KV Block Manager", "Workers", "Disaggregated", "SLA planner"):
        assert any(title.startswith(row) for title in titles), f"no row {row}"


def test_every_panel_has_a_datasource_and_a_target() -> None:
    for panel in panels(dashboard()):
        if panel["type"] == "row":
            continue
        title = panel["title"]
        assert panel.get("datasource", {}).get("uid") == "${datasource}", f"{title}: no templated datasource"
        assert panel.get("targets"), f"{title}: no target"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{title}: target {target.get('refId')} has no expression"
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{title}: refIds repeat"


def test_every_dashboard_query_names_a_series_strata_exports() -> None:
    board = dashboard()
    queries = [
        (panel["title"], target["expr"]) for panel in panels(board) for target in panel.get("targets", [])
    ]
    queries += [
        (f"variable {v['name']}", v["query"]["query"])
        for v in board["templating"]["list"]
        if v["type"] == "query"
    ]
    unknown = [
        f"{title}: {name}"
        for title, expr in queries
        for name in SERIES.findall(expr)
        if name not in exported()
    ]
    assert not unknown, "series Strata does not export:\n" + "\n".join(unknown)
    named = {name for _, expr in queries for name in SERIES.findall(expr)}
    for prefix in (
        "strata_time_to_first_token_seconds_bucket",
        "strata_planner_",
        "strata_disagg_",
        "kvbm_tier_",
    ):
        assert any(name.startswith(prefix) for name in named), f"no panel queries {prefix}*"


# ---------------------------------------------------------------------------------------------------- object store


def json_patch_add(document: dict, ops: list[dict]) -> dict:
    """`document` with the JSON-patch `add` operations applied (the only operation the component uses)."""
    patched = copy.deepcopy(document)
    for op in ops:
        assert op["op"] == "add", f"unexpected patch operation {op}"
        *parents, last = op["path"].strip("/").split("/")
        node = patched
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if last == "-":
            node.append(op["value"])
        else:
            node[last] = op["value"]
    return patched


def test_the_object_store_component_gives_every_worker_g5_and_its_credentials() -> None:
    """deploy/kubernetes/object-store: a kustomize Component whose patches, applied to the worker Deployments,
    give a command line Strata's parser accepts with an s3:// URL, and the AWS environment from a Secret that
    validates and carries exactly the standard variable names."""
    folder = K8S / "object-store"
    component = yaml.safe_load((folder / KUSTOMIZATION).read_text())
    assert component["kind"] == "Component"
    (secret,) = [
        doc for name in component["resources"] for doc in yaml.safe_load_all((folder / name).read_text())
    ]
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert set(secret["stringData"]) <= {
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL",
    }  # fmt: skip
    targets = {patch["target"]["name"]: patch["path"] for patch in component["patches"]}
    assert set(targets) == set(WORKER_DEPLOYMENTS)
    parser = strata_parser()
    for name, path in targets.items():
        deployment = json_patch_add(of_kind("Deployment")[name], yaml.safe_load((folder / path).read_text()))
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = parse(parser, argv(container), name)
        assert args.kvbm_object_url.startswith("s3://")
        assert {"secretRef": {"name": secret["metadata"]["name"]}} in container["envFrom"]
