"""The planner's connector and leadership on Kubernetes: one Deployment per worker role, one Lease per planner group.

`KubernetesConnector` scales the prefill/decode/both Deployments of a namespace through their scale subresource.
A Deployment's `spec.replicas` is what it counts: pods running or starting; pods terminating on a scale-down are
draining (SIGTERM, then `--exit-timeout-secs`), so they are not counted, as `WorkerConnector.workers` asks.

`KubernetesLeadership` holds a coordination.k8s.io/v1 Lease through the client's own Lease lock
(`kubernetes.leaderelection.resourcelock.leaselock.LeaseLock`: get/create/update of a `LeaderElectionRecord`,
with the Lease's resourceVersion as optimistic concurrency). The client's `LeaderElection.run()` blocks and sleeps;
the planner asks once per tick instead, so each `is_leader()` makes one acquire-or-renew attempt by the same rules
as client-go and the client's `try_acquire_or_renew`:

    no Lease              create it (a 409 from a faster planner: not leader)
    free or ours          write our record (renewTime now; acquireTime kept while it stays ours)
    another holder        not leader until leaseDurationSeconds have passed, on our clock, since we first saw
                          that record unchanged (so clock skew between pods does not matter), then take it
    409 on the write      not leader (another planner wrote first)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from http import HTTPStatus
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from server.planner.connector import ROLES

logger = logging.getLogger(__name__)

# Where Kubernetes mounts the namespace of a pod's service account: the planner's own namespace.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ConnectorError(RuntimeError):
    """A Kubernetes API call on a Deployment failed. `status` is the HTTP status, None when the API was not
    reached at all."""

    def __init__(self, deployment: str, namespace: str, status: int | None, detail: str) -> None:
        where = f"Deployment {deployment!r} in namespace {namespace!r}"
        if status is None:
            message = f"{where}: Kubernetes API unreachable ({detail})"
        else:
            message = f"{where}: Kubernetes API answered HTTP {status} {detail}".rstrip()
        super().__init__(message)
        self.deployment = deployment
        self.namespace = namespace
        self.status = status


class KubernetesConnector:
    """Scales one Deployment per role (`deployments`: role -> Deployment name) in `namespace`.

    `dry_run` logs what it would change and changes nothing; `workers()` still reads the real counts. The
    Deployments' pods are the workers: `close()` leaves them as they are.
    """

    def __init__(
        self, apps_api: client.AppsV1Api, namespace: str, deployments: dict[str, str], dry_run: bool = False
    ) -> None:
        unknown = sorted(set(deployments) - set(ROLES))
        if unknown:
            raise ValueError(f"deployments name unknown roles {unknown}; the roles are {list(ROLES)}")
        if not deployments:
            raise ValueError(
                f"deployments is empty: name the Deployment of at least one role of {list(ROLES)}"
            )
        self._apps_api = apps_api
        self._namespace = namespace
        self._deployments = dict(deployments)
        self._dry_run = dry_run

    @classmethod
    def from_cluster(
        cls, namespace: str | None, deployments: dict[str, str], dry_run: bool = False
    ) -> KubernetesConnector:
        """Connect with the pod's service account (else ~/.kube/config); namespace None: the pod's own."""
        load_cluster_config()
        return cls(client.AppsV1Api(), namespace or pod_namespace(), deployments, dry_run)

    def workers(self) -> dict[str, int]:
        """Desired replicas (running or starting) of each role's Deployment."""
        return {role: self._replicas(deployment) for role, deployment in self._deployments.items()}

    def scale(self, role: str, count: int) -> None:
        """Set the role's Deployment to `count` replicas; no API write when it already has that many."""
        deployment = self._deployment(role)
        if count < 0:
            raise ValueError(f"cannot scale {role} workers to {count}: the count must be 0 or more")
        current = self._replicas(deployment)
        if current == count:
            return
        if self._dry_run:
            logger.info("dry run: would scale %s from %d to %d", deployment, current, count)
            return
        logger.info("scaling %s/%s from %d to %d", self._namespace, deployment, current, count)
        with self._api_errors(deployment):
            self._apps_api.patch_namespaced_deployment_scale(
                deployment, self._namespace, {"spec": {"replicas": count}}
            )

    def close(self) -> None:
        """Nothing to stop: the Deployments keep the replicas they were last given."""

    def _deployment(self, role: str) -> str:
        if role not in self._deployments:
            raise ValueError(
                f"no Deployment for role {role!r}; this connector scales {sorted(self._deployments)}"
            )
        return self._deployments[role]

    def _replicas(self, deployment: str) -> int:
        with self._api_errors(deployment):
            scale = self._apps_api.read_namespaced_deployment_scale(deployment, self._namespace)
        return scale.spec.replicas or 0  # the API leaves replicas out when it is 0

    @contextmanager
    def _api_errors(self, deployment: str) -> Iterator[None]:
        """Turn the client's errors into a ConnectorError naming the Deployment, the namespace and the status."""
        try:
            yield
        except ApiException as exc:
            error = ConnectorError(deployment, self._namespace, exc.status, exc.reason or "")
            logger.warning("%s", error)
            raise error from exc
        except urllib3.exceptions.HTTPError as exc:
            error = ConnectorError(deployment, self._namespace, None, str(exc))
            logger.warning("%s", error)
            raise error from exc


@dataclass(frozen=True, slots=True)
class _Sighting:
    """A lease record held by another planner, and when (our clock, seconds) we first saw it unchanged."""

    record: tuple[Any, ...]
    seen_at_s: float


class KubernetesLeadership:
    """Planner leadership as the Lease `lease_name` in `namespace`, held by `identity` (unique per planner, e.g.
    the pod name) for `lease_s` seconds (rounded up to whole seconds, as the Lease stores them) after each renewal.

    `clock` is epoch seconds (tests pass a fake one). Never raises from `is_leader()` or `release()`: a failure
    is logged and means not leader; an unreleased lease frees itself after `lease_s`.
    """

    def __init__(
        self,
        coordination_api: client.CoordinationV1Api,
        namespace: str,
        lease_name: str,
        identity: str,
        lease_s: float = 15.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if lease_s < 1:
            raise ValueError(f"lease_s is {lease_s}; a Lease lasts at least 1 s")
        self._lock = LeaseLock(lease_name, namespace, identity)
        self._lock.api_instance = coordination_api  # the lock builds a default client; use the one given
        self._lease_s = math.ceil(lease_s)
        self._clock = clock
        self._sighting: _Sighting | None = None
        self._leading = False

    @classmethod
    def from_cluster(
        cls, namespace: str | None, lease_name: str, identity: str, lease_s: float = 15.0
    ) -> KubernetesLeadership:
        """Connect with the pod's service account (else ~/.kube/config); namespace None: the pod's own."""
        load_cluster_config()
        return cls(client.CoordinationV1Api(), namespace or pod_namespace(), lease_name, identity, lease_s)

    def is_leader(self) -> bool:
        """One attempt to take or renew the lease; True while we hold it."""
        try:
            leading = self._try_acquire_or_renew(self._clock())
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            logger.warning("lease %s: Kubernetes API unreachable, not leader (%s)", self._where(), exc)
            leading = False
        except Exception:  # the protocol's invariant: is_leader never raises, and a failure is not leadership
            logger.exception("lease %s: unexpected error, not leader", self._where())
            leading = False
        if leading != self._leading:
            logger.info("%s %s lease %s", self._lock.identity, "took" if leading else "lost", self._where())
        self._leading = leading
        return leading

    def release(self) -> None:
        """Clear the holder if it is us, so another planner takes the lease at its next attempt."""
        self._leading, self._sighting = False, None
        try:
            released = self._clear_holder(_record_time(self._clock()))
        except Exception:  # stopping anyway: the lease expires on its own
            logger.warning("lease %s: release failed", self._where(), exc_info=True)
            released = False
        if released:
            logger.info("%s released lease %s", self._lock.identity, self._where())

    def _clear_holder(self, now: str) -> bool:
        """Write an empty holder (with client-go's 1 s duration) if the lease is ours; False if it is not."""
        found, current = self._lock.get(self._lock.name, self._lock.namespace)
        if not found or current.holder_identity != self._lock.identity:
            return False
        return self._lock.update(
            self._lock.name, self._lock.namespace, LeaderElectionRecord("", "1", now, now)
        )

    def _try_acquire_or_renew(self, now_s: float) -> bool:
        found, current = self._lock.get(self._lock.name, self._lock.namespace)
        if not found:
            return self._create(current, now_s)
        if self._held_by_another(current, now_s):
            return False
        now = _record_time(now_s)
        ours = current.holder_identity == self._lock.identity
        record = LeaderElectionRecord(
            self._lock.identity, str(self._lease_s), current.acquire_time if ours else now, now
        )
        return self._lock.update(self._lock.name, self._lock.namespace, record)

    def _create(self, read_error: ApiException, now_s: float) -> bool:
        if read_error.status != HTTPStatus.NOT_FOUND:
            logger.warning(
                "lease %s: read failed, HTTP %s %s", self._where(), read_error.status, read_error.reason
            )
            return False
        now = _record_time(now_s)
        record = LeaderElectionRecord(self._lock.identity, str(self._lease_s), now, now)
        return self._lock.create(self._lock.name, self._lock.namespace, record)

    def _held_by_another(self, current: LeaderElectionRecord, now_s: float) -> bool:
        """True while another planner's record is fresh: unchanged for less than its leaseDurationSeconds."""
        record = (current.holder_identity, current.lease_duration, current.acquire_time, current.renew_time)
        if None in record or current.holder_identity == self._lock.identity:
            self._sighting = None
            return False  # free (released or incomplete), or ours
        if self._sighting is None or self._sighting.record != record:
            self._sighting = _Sighting(record, now_s)
        return now_s < self._sighting.seen_at_s + int(current.lease_duration)

    def _where(self) -> str:
        return f"{self._lock.namespace}/{self._lock.name}"


def _record_time(epoch_s: float) -> str:
    """A LeaderElectionRecord time: local wall clock as str(datetime), which LeaseLock stores as UTC."""
    return str(datetime.fromtimestamp(epoch_s))


def load_cluster_config() -> None:
    """Load the client's configuration: the pod's service account in a cluster, else ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def pod_namespace() -> str:
    """The namespace this pod runs in, from its service account mount."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except OSError as exc:
        raise ValueError(f"no namespace given and {SERVICE_ACCOUNT_NAMESPACE} is unreadable ({exc})") from exc
