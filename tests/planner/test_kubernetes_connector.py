"""The planner's Kubernetes connector and leadership (server/planner/kubernetes.py) against in-memory fakes of
AppsV1Api and CoordinationV1Api.

No cluster runs here: the fakes keep the real client's model classes (V1Scale, V1Lease, V1LeaseSpec) and its
errors (ApiException with the HTTP status; a 409 when a Lease write carries a stale resourceVersion or creates one
that exists; urllib3's MaxRetryError when the API is unreachable). The lease clock is a fake one, not a sleep.
"""

from __future__ import annotations

import copy
import logging
import re

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from server.planner import kubernetes as k8s
from server.planner.kubernetes import ConnectorError, KubernetesConnector, KubernetesLeadership

NAMESPACE = "strata"
DEPLOYMENTS = {"prefill": "strata-prefill", "decode": "strata-decode"}
LEASE = "strata-planner"
UNREACHABLE = urllib3.exceptions.MaxRetryError(None, "/apis", "connection refused")


class FakeAppsApi:
    """The scale subresource of some Deployments: name -> spec.replicas; `error` is raised by every call."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)
        self.patches: list[tuple[str, str, dict]] = []
        self.error: Exception | None = None

    def read_namespaced_deployment_scale(self, name: str, namespace: str) -> client.V1Scale:
        self._check(name, namespace)
        replicas = self.replicas[name]
        return client.V1Scale(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            spec=client.V1ScaleSpec(replicas=replicas or None),  # the API leaves out a 0
            status=client.V1ScaleStatus(replicas=replicas),
        )

    def patch_namespaced_deployment_scale(self, name: str, namespace: str, body: dict) -> client.V1Scale:
        self._check(name, namespace)
        self.patches.append((name, namespace, body))
        self.replicas[name] = body["spec"]["replicas"]
        return self.read_namespaced_deployment_scale(name, namespace)

    def _check(self, name: str, namespace: str) -> None:
        if self.error is not None:
            raise self.error
        if namespace != NAMESPACE or name not in self.replicas:
            raise ApiException(status=404, reason="Not Found")


class FakeCoordinationApi:
    """Leases by name, with the API server's optimistic concurrency on resourceVersion."""

    def __init__(self) -> None:
        self.leases: dict[str, client.V1Lease] = {}
        self.version = 0
        self.unreachable = False
        self.conflict_on_next_replace = False

    def read_namespaced_lease(self, name: str, namespace: str) -> client.V1Lease:
        self._check_reachable()
        if name not in self.leases:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.leases[name])

    def create_namespaced_lease(self, namespace: str, body: client.V1Lease) -> client.V1Lease:
        self._check_reachable()
        if body.metadata.name in self.leases:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(body.metadata.name, namespace, body.spec)

    def replace_namespaced_lease(self, name: str, namespace: str, body: client.V1Lease) -> client.V1Lease:
        self._check_reachable()
        if self.conflict_on_next_replace:  # another writer got there between our read and this write
            self.conflict_on_next_replace = False
            self._store(name, namespace, self.leases[name].spec)
        if body.metadata.resource_version != self.leases[name].metadata.resource_version:
            raise ApiException(status=409, reason="Conflict")
        return self._store(name, namespace, body.spec)

    def holder(self) -> str | None:
        return self.leases[LEASE].spec.holder_identity

    def _store(self, name: str, namespace: str, spec: client.V1LeaseSpec) -> client.V1Lease:
        self.version += 1
        meta = client.V1ObjectMeta(name=name, namespace=namespace, resource_version=str(self.version))
        self.leases[name] = client.V1Lease(metadata=meta, spec=copy.deepcopy(spec))
        return copy.deepcopy(self.leases[name])

    def _check_reachable(self) -> None:
        if self.unreachable:
            raise UNREACHABLE


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1_800_000_000.5

    def __call__(self) -> float:
        return self.now_s


# --- the connector ---


@pytest.fixture
def apps() -> FakeAppsApi:
    return FakeAppsApi({"strata-prefill": 2, "strata-decode": 0})


def test_workers_reads_each_deployments_replicas(apps: FakeAppsApi) -> None:
    connector = KubernetesConnector(apps, NAMESPACE, DEPLOYMENTS)
    assert connector.workers() == {"prefill": 2, "decode": 0}


def test_scale_patches_only_a_change(apps: FakeAppsApi) -> None:
    connector = KubernetesConnector(apps, NAMESPACE, DEPLOYMENTS)
    connector.scale("prefill", 2)
    assert apps.patches == []
    connector.scale("decode", 3)
    assert apps.patches == [("strata-decode", NAMESPACE, {"spec": {"replicas": 3}})]
    assert connector.workers() == {"prefill": 2, "decode": 3}


def test_dry_run_logs_the_change_and_makes_none(apps: FakeAppsApi, caplog: pytest.LogCaptureFixture) -> None:
    connector = KubernetesConnector(apps, NAMESPACE, DEPLOYMENTS, dry_run=True)
    with caplog.at_level(logging.INFO, logger=k8s.__name__):
        connector.scale("prefill", 5)
    assert apps.patches == []
    assert connector.workers() == {"prefill": 2, "decode": 0}
    assert "would scale strata-prefill from 2 to 5" in caplog.text


@pytest.mark.parametrize(
    ("deployments", "role", "count", "message"),
    [
        (
            DEPLOYMENTS,
            "both",
            1,
            "no Deployment for role 'both'; this connector scales ['decode', 'prefill']",
        ),
        (DEPLOYMENTS, "prefill", -1, "cannot scale prefill workers to -1"),
        ({"prefil": "x"}, None, None, "unknown roles ['prefil']"),
        ({}, None, None, "deployments is empty"),
    ],
)
def test_bad_roles_and_counts_are_value_errors(apps, deployments, role, count, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        KubernetesConnector(apps, NAMESPACE, deployments).scale(role, count)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            ApiException(status=403, reason="Forbidden"),
            "namespace 'strata': Kubernetes API answered HTTP 403 Forbidden",
        ),
        (ApiException(status=500, reason="Internal Server Error"), "HTTP 500 Internal Server Error"),
        (UNREACHABLE, "namespace 'strata': Kubernetes API unreachable"),
    ],
)
@pytest.mark.parametrize("call", ["workers", "scale"])
def test_api_errors_are_connector_errors_naming_deployment_namespace_status(
    apps, error, expected, call
) -> None:
    connector = KubernetesConnector(apps, NAMESPACE, {"decode": "strata-decode"})
    apps.error = error
    with pytest.raises(ConnectorError, match=expected) as raised:
        connector.workers() if call == "workers" else connector.scale("decode", 4)
    assert "Deployment 'strata-decode'" in str(raised.value)
    assert (raised.value.deployment, raised.value.namespace) == ("strata-decode", NAMESPACE)
    assert raised.value.status == getattr(error, "status", None)
    assert raised.value.__cause__ is error


def test_from_cluster_falls_back_to_kubeconfig_and_reads_the_pods_namespace(monkeypatch, tmp_path) -> None:
    loaded: list[str] = []

    def not_in_a_pod() -> None:
        loaded.append("incluster")
        raise k8s.config.ConfigException("not in a pod")

    monkeypatch.setattr(k8s.config, "load_incluster_config", not_in_a_pod)
    monkeypatch.setattr(k8s.config, "load_kube_config", lambda: loaded.append("kubeconfig"))
    # kubernetes.client loads AppsV1Api lazily (0.5 s); setattr would load it to restore it, setitem does not
    monkeypatch.setitem(vars(k8s.client), "AppsV1Api", lambda: FakeAppsApi({}))
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text("strata-prod\n")
    monkeypatch.setattr(k8s, "SERVICE_ACCOUNT_NAMESPACE", namespace_file)
    connector = KubernetesConnector.from_cluster(None, DEPLOYMENTS)
    assert loaded == ["incluster", "kubeconfig"]
    assert connector._namespace == "strata-prod"
    assert isinstance(connector._apps_api, FakeAppsApi)
    monkeypatch.setattr(k8s, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "absent")
    with pytest.raises(ValueError, match="no namespace given"):
        KubernetesConnector.from_cluster(None, DEPLOYMENTS)


# --- leadership ---


@pytest.fixture
def leases() -> FakeCoordinationApi:
    return FakeCoordinationApi()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def planner(leases: FakeCoordinationApi, clock: FakeClock, identity: str) -> KubernetesLeadership:
    return KubernetesLeadership(leases, NAMESPACE, LEASE, identity, lease_s=15.0, clock=clock)


def test_first_planner_takes_the_lease_and_a_second_is_refused_while_it_is_fresh(leases, clock) -> None:
    a, b = planner(leases, clock, "planner-a"), planner(leases, clock, "planner-b")
    assert a.is_leader()
    assert leases.holder() == "planner-a"
    assert leases.leases[LEASE].spec.lease_duration_seconds == 15
    clock.now_s += 14
    assert not b.is_leader()
    assert leases.holder() == "planner-a"


def test_second_planner_takes_an_expired_lease_and_the_first_then_is_not_leader(leases, clock) -> None:
    a, b = planner(leases, clock, "planner-a"), planner(leases, clock, "planner-b")
    assert a.is_leader()
    assert not b.is_leader()  # b sees a's record now: it must stay unchanged for 15 s
    clock.now_s += 16
    assert b.is_leader()
    assert leases.holder() == "planner-b"
    assert not a.is_leader()


def test_renewing_keeps_the_lease_and_its_acquire_time(leases, clock) -> None:
    a, b = planner(leases, clock, "planner-a"), planner(leases, clock, "planner-b")
    assert a.is_leader()
    acquired = leases.leases[LEASE].spec.acquire_time
    for _ in range(4):  # 40 s in all, renewed every 10 s: never 15 s unchanged
        clock.now_s += 10
        assert not b.is_leader()
        assert a.is_leader()
    spec = leases.leases[LEASE].spec
    assert (spec.holder_identity, spec.acquire_time) == ("planner-a", acquired)
    assert spec.renew_time.timestamp() == pytest.approx(clock.now_s)


def test_a_stale_lease_seen_for_the_first_time_is_waited_out(leases, clock) -> None:
    """client-go's rule: expiry counts on the reader's clock from when it first saw the record, not from the
    record's renewTime, so a skewed clock cannot steal a live lease."""
    assert planner(leases, clock, "planner-a").is_leader()
    clock.now_s += 60
    b = planner(leases, clock, "planner-b")
    assert not b.is_leader()
    clock.now_s += 15
    assert b.is_leader()


def test_release_lets_another_planner_take_the_lease_at_once(leases, clock) -> None:
    a, b = planner(leases, clock, "planner-a"), planner(leases, clock, "planner-b")
    assert a.is_leader()
    assert not b.is_leader()
    b.release()  # not the holder: changes nothing
    assert leases.holder() == "planner-a"
    a.release()
    assert not leases.holder()
    assert b.is_leader()


@pytest.mark.parametrize("existing_lease", [False, True], ids=["create", "renew"])
def test_a_conflicting_write_is_not_leadership(leases, clock, existing_lease) -> None:
    a = planner(leases, clock, "planner-a")
    if existing_lease:
        assert a.is_leader()
        leases.conflict_on_next_replace = True
    else:  # another planner creates the Lease between our read and our create
        real_read = leases.read_namespaced_lease

        def read_then_lose_the_race(name: str, namespace: str) -> client.V1Lease:
            try:
                return real_read(name, namespace)
            finally:
                leases.read_namespaced_lease = real_read
                planner(leases, clock, "planner-b").is_leader()

        leases.read_namespaced_lease = read_then_lose_the_race
    assert not a.is_leader()
    assert a.is_leader() == existing_lease  # next tick: its own lease renews; b's fresh one is refused


def test_an_unreachable_api_is_not_leadership_and_raises_nothing(leases, clock, caplog) -> None:
    a = planner(leases, clock, "planner-a")
    assert a.is_leader()
    leases.unreachable = True
    assert not a.is_leader()
    a.release()
    assert "Kubernetes API unreachable, not leader" in caplog.text
    leases.unreachable = False
    assert a.is_leader()


def test_a_read_error_other_than_not_found_is_not_leadership(leases, clock) -> None:
    def forbidden(name: str, namespace: str) -> client.V1Lease:
        raise ApiException(status=403, reason="Forbidden")

    leases.read_namespaced_lease = forbidden
    assert not planner(leases, clock, "planner-a").is_leader()
    assert leases.leases == {}
