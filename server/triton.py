"""The real Triton Inference Server (the binary bundled in PyTriton's wheel), started and controlled by Strata.

Strata owns Triton's model store (PyTriton's workspace `model-store`, a fresh folder per run): file backends stage
models there and Strata loads them through Triton's repository API; the LLM backend binds callables through
PyTriton, which writes its proxy models into the same store. So `tritonclient`'s repository index, load and unload
see one repository.

Access control is tritonserver's own: `--http-restricted-api` / `--grpc-restricted-protocol` values
(`API[,API...]:HEADER=VALUE`) go to the binary unchanged; `--access-token T` is the short form for the APIs
PyTriton protects by default. Strata's and PyTriton's own control calls (load, unload, health, logging) send
`triton-access-token`, so a restriction on those APIs must use that header (checked at start, naming the flag).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import tritonclient.grpc.aio as grpc_aio
from prometheus_client import CollectorRegistry
from pytriton.triton import Triton, TritonLifecyclePolicy, TritonSecurityConfig
from pytriton.utils.workspace import Workspace
from tritonclient.grpc import InferenceServerClient
from tritonclient.utils import InferenceServerException

from kvbm.host_pool import pid_alive
from server import pytriton_patches, settings
from server.metrics_endpoint import MetricsEndpoint

log = logging.getLogger(__name__)

ACCESS_HEADER = "triton-access-token"
GRPC_HEADER_PREFIX = (
    "triton-grpc-protocol-"  # tritonserver reads a gRPC restriction's KEY from this metadata key
)
PROTECTED_APIS = (
    "model-repository",
    "shared-memory",
    "statistics",
    "trace",
    "logging",
)  # --access-token's APIs
# tritonserver's restrictable API groups (HTTP) and protocols (gRPC) share these names
RESTRICTABLE_APIS = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
_CONTROL_APIS = {
    "health",
    "metadata",
    "model-config",
    "model-repository",
    "logging",
}  # what Strata itself calls
_SHM_DIR = Path("/dev/shm")


class PortInUse(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Restriction:
    """One `--http-restricted-api` / `--grpc-restricted-protocol` value: these APIs need `header: value`."""

    apis: tuple[str, ...]
    header: str
    value: str

    @classmethod
    def parse(cls, flag: str, text: str) -> Restriction:
        """`API[,API...]:HEADER=VALUE`, as tritonserver takes it; ValueError names the flag and the problem."""
        apis, sep, credential = text.partition(":")
        header, eq, value = credential.partition("=")
        if not (sep and eq and apis and header and value):
            raise ValueError(f"{flag} {text!r}: expected API[,API...]:HEADER=VALUE")
        names = tuple(api.strip() for api in apis.split(","))
        unknown = sorted(set(names) - set(RESTRICTABLE_APIS))
        if unknown:
            raise ValueError(f"{flag}: unknown API {unknown[0]!r}; one of {', '.join(RESTRICTABLE_APIS)}")
        return cls(names, header.strip(), value)

    def __str__(self) -> str:
        return f"{','.join(self.apis)}:{self.header}={self.value}"


@dataclass(frozen=True, slots=True)
class GrpcSSL:
    """tritonserver's gRPC TLS flags (paths to PEM files); `mutual` also requires client certificates."""

    server_cert: str
    server_key: str
    root_cert: str | None = None
    mutual: bool = False


@dataclass(slots=True)
class TritonSettings:
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "0.0.0.0"
    strict_readiness: bool = True
    exit_timeout_secs: int = 30
    log_verbose: int = 0
    trace_config: tuple[str, ...] = ()  # tritonserver's --trace-config settings, passed through
    access_token: str | None = None  # short form: PROTECTED_APIS need triton-access-token on HTTP and gRPC
    http_restricted: tuple[Restriction, ...] = ()
    grpc_restricted: tuple[Restriction, ...] = ()
    grpc_ssl: GrpcSSL | None = None
    auto_complete: bool = True  # False: --disable-auto-complete-config
    cache_config: tuple[str, ...] = ()  # --cache-config values, e.g. "local,size=1048576"
    rate_limit: str = "off"  # or "execution_count"
    rate_limit_resource: tuple[str, ...] = ()

    def ports(self) -> dict[str, int]:
        return {
            "--http-port": self.http_port,
            "--grpc-port": self.grpc_port,
            "--metrics-port": self.metrics_port,
        }

    def restrictions(self) -> tuple[tuple[Restriction, ...], tuple[Restriction, ...]]:
        """(HTTP, gRPC) restrictions, --access-token expanded into both."""
        if self.access_token is None:
            return self.http_restricted, self.grpc_restricted
        short = (Restriction(PROTECTED_APIS, ACCESS_HEADER, self.access_token),)
        return self.http_restricted + short, self.grpc_restricted + short

    def control_token(self) -> str | None:
        """The triton-access-token value Strata's own control calls send (None: they need none).

        Raises ValueError when a restriction would lock Strata out of its own Triton: APIs it calls restricted
        by another header, or by two different values, or the same API restricted twice (tritonserver refuses)."""
        tokens: set[str] = set()
        for flag, restrictions in zip(
            ("--http-restricted-api", "--grpc-restricted-protocol"), self.restrictions(), strict=True
        ):
            seen: set[str] = set()
            for restriction in restrictions:
                twice = seen & set(restriction.apis)
                if twice:
                    raise ValueError(f"{flag}: {sorted(twice)[0]} is restricted twice (with --access-token?)")
                seen |= set(restriction.apis)
                if not _CONTROL_APIS & set(restriction.apis):
                    continue
                if restriction.header != ACCESS_HEADER:
                    raise ValueError(
                        f"{flag} {','.join(restriction.apis)}: Strata's own control calls "
                        f"({', '.join(sorted(_CONTROL_APIS))}) send the header {ACCESS_HEADER}; "
                        f"restrict these APIs with {ACCESS_HEADER}=<token>"
                    )
                tokens.add(restriction.value)
        if len(tokens) > 1:
            raise ValueError(
                f"the APIs Strata calls itself ({', '.join(sorted(_CONTROL_APIS))}) must share one "
                f"{ACCESS_HEADER} value across --http-restricted-api and --grpc-restricted-protocol"
            )
        return tokens.pop() if tokens else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_ports_free(address: str, ports: dict[str, int]) -> None:
    """Fail fast, naming the flag and the port, instead of letting Triton wait out its startup timeout."""
    for flag, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError as exc:
                raise PortInUse(
                    f"port {port} ({flag}) is already in use on {address}: {exc.strerror}"
                ) from exc


def _access_flags(c: TritonSettings) -> dict[str, object]:
    """TritonConfig fields for the restrictions and gRPC TLS (lists become repeated tritonserver flags)."""
    http, grpc = c.restrictions()
    flags: dict[str, object] = {}
    if http:
        flags["http_restricted_api"] = [str(r) for r in http]
    if grpc:
        flags["grpc_restricted_protocol"] = [str(r) for r in grpc]
    if c.grpc_ssl is not None:
        ssl = c.grpc_ssl
        flags.update(
            grpc_use_ssl=True,
            grpc_use_ssl_mutual=ssl.mutual or None,
            grpc_server_cert=ssl.server_cert,
            grpc_server_key=ssl.server_key,
            grpc_root_cert=ssl.root_cert,
        )
    return flags


def clean_stale_runs(runtime_dir: Path) -> None:
    """Remove what runs killed with -9 left behind: their workspaces and Python-backend shared memory."""
    for workspace in runtime_dir.glob("serve-*"):
        match = re.match(r"serve-(\d+)-", workspace.name)
        if match and not pid_alive(int(match.group(1))):
            log.info("removing workspace of dead run %s", workspace)
            _remove_tree(workspace)
    for region in _SHM_DIR.glob("pytrtion*"):
        match = re.match(r"pytrtion(\d+)-", region.name)
        if match and not pid_alive(int(match.group(1))):
            log.info("removing leaked shared memory %s", region)
            region.unlink(missing_ok=True)


def _remove_tree(root: Path) -> None:
    """rm -r that never follows a link (staged models point into operators' repositories): a `root` that is a link
    is unlinked; below it, shutil.rmtree walks directory file descriptors (`shutil.rmtree.avoids_symlink_attacks`
    on Linux), so a link is unlinked, never descended, even one that replaces a folder while the tree is removed."""
    if root.is_symlink():
        root.unlink()
    else:
        shutil.rmtree(root)


class TritonServer:
    """One Triton process with a fresh workspace; `store` is its model repository.

    Given `registry`, the metrics port is Strata's (server/metrics_endpoint.py: Triton's series, then the
    registry's) and Triton's own metrics listen on a free loopback port; without one, Triton serves the port."""

    def __init__(self, config: TritonSettings, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry
        self._metrics: MetricsEndpoint | None = None
        runtime = settings.runtime_dir()
        runtime.mkdir(parents=True, exist_ok=True)
        clean_stale_runs(runtime)
        check_ports_free(config.address, config.ports())
        self._workspace = Workspace(runtime / f"serve-{os.getpid()}-{secrets.token_hex(4)}")
        self.store = self._workspace.model_store_path
        self._triton: Triton | None = None

    def start(self) -> None:
        pytriton_patches.apply()
        # the Python-backend stub must load this interpreter's libpython (BRIEF: PyTriton quirk)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        os.environ["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
        c = self.config
        triton_metrics = (c.address, c.metrics_port) if self.registry is None else ("127.0.0.1", _free_port())
        triton_config = pytriton_patches.CoreConfig(
            strict_model_config=not c.auto_complete or None,
            cache_config=list(c.cache_config) or None,
            rate_limit=c.rate_limit if c.rate_limit != "off" else None,
            rate_limit_resource=list(c.rate_limit_resource) or None,
            model_repository=self.store,
            http_address=c.address,
            grpc_address=c.address,
            http_port=c.http_port,
            grpc_port=c.grpc_port,
            metrics_address=triton_metrics[0],
            metrics_port=triton_metrics[1],
            strict_readiness=c.strict_readiness,
            exit_on_error=False,  # a model staged before start that fails to load (StartupHold) is no reason to exit
            exit_timeout_secs=c.exit_timeout_secs,
            log_verbose=c.log_verbose,
            trace_config=list(c.trace_config) or None,
            allow_gpu_metrics=False,
            **_access_flags(c),
        )
        # PyTriton's own clients send the token; the restrictions themselves are the flags above, not PyTriton's
        security = TritonSecurityConfig(access_token=c.control_token(), restricted_endpoints=[])
        self._triton = Triton(
            config=triton_config,
            workspace=self._workspace,
            triton_lifecycle_policy=TritonLifecyclePolicy(local_model_store=True),
            security_config=security,
        )
        self._triton.run()
        if self.registry is not None:
            url = f"http://{triton_metrics[0]}:{triton_metrics[1]}/metrics"
            self._metrics = MetricsEndpoint(c.address, c.metrics_port, self.registry, url)
            self._metrics.start()
        log.info("Triton serving: HTTP %d, gRPC %d, metrics %d", c.http_port, c.grpc_port, c.metrics_port)

    @property
    def pytriton(self) -> Triton:
        if self._triton is None:
            raise RuntimeError("Triton is not started")
        return self._triton

    @contextmanager
    def client(self) -> Iterator[InferenceServerClient]:
        """A gRPC client to this Triton for control calls (load, unload, index)."""
        url, tls = self._grpc_target()
        client = InferenceServerClient(url, **tls)
        try:
            yield client
        finally:
            client.close()

    def inference_client(self) -> grpc_aio.InferenceServerClient:
        """An asyncio gRPC client to this Triton for inference calls (the OpenAI frontend's /v1/embeddings), made
        in the event loop that uses it."""
        url, tls = self._grpc_target()
        return grpc_aio.InferenceServerClient(url, **tls)

    def _grpc_target(self) -> tuple[str, dict[str, object]]:
        """The loopback gRPC address and TLS arguments of both clients (tritonclient's sync and asyncio ones take
        the same): with gRPC TLS the certificate names the server's host, not 127.0.0.1, so it is checked against
        localhost."""
        ssl = self.config.grpc_ssl
        if ssl is None:
            return f"127.0.0.1:{self.config.grpc_port}", {}
        return f"localhost:{self.config.grpc_port}", {
            "ssl": True,
            "root_certificates": ssl.root_cert or ssl.server_cert,
            "private_key": ssl.server_key if ssl.mutual else None,
            "certificate_chain": ssl.server_cert if ssl.mutual else None,
        }

    @property
    def inference_headers(self) -> dict[str, str] | None:
        """gRPC metadata an inference call needs: the header of a --grpc-restricted-protocol on inference."""
        for restriction in self.config.restrictions()[1]:
            if "inference" in restriction.apis:
                return {GRPC_HEADER_PREFIX + restriction.header: restriction.value}
        return None

    @property
    def headers(self) -> dict[str, str] | None:
        """gRPC metadata for Strata's control calls (the client above is gRPC)."""
        token = self.config.control_token()
        return {GRPC_HEADER_PREFIX + ACCESS_HEADER: token} if token else None

    def load(self, name: str) -> None:
        """Load (or reload) a model from the store; raises InferenceServerException with Triton's reason."""
        with self.client() as client:
            client.load_model(name, headers=self.headers)

    def unload(self, name: str) -> None:
        with self.client() as client:
            client.unload_model(name, headers=self.headers)

    def wait_unloaded(self, name: str, timeout_s: float = 30.0) -> None:
        """Wait until Triton lists every version of staged model `name` as unloaded (its unload runs in the
        background; Triton offers no event for it, so the index is read every 50 ms)."""
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while time.monotonic() < deadline:
                rows = client.get_model_repository_index(headers=self.headers, as_json=True).get("models", [])
                mine = [row for row in rows if row.get("name") == name and row.get("version")]
                if all(row.get("state") == "UNAVAILABLE" and row.get("reason") == "unloaded" for row in mine):
                    return
                time.sleep(0.05)
        log.warning("%s: still unloading after %.0f s", name, timeout_s)

    def unbind(self, name: str) -> None:
        """Unload a PyTriton-bound model and forget its binding, so the name can be bound again (reload).

        PyTriton has no public unbind; its model registry is keyed by (lower-case name, version).
        """
        registry = self.pytriton._model_manager._models
        for key in [k for k in registry if k[0] == name.lower()]:
            model = registry.pop(key)
            try:
                self.unload(name)
            except InferenceServerException as exc:
                log.warning("%s: unload during unbind failed: %s", name, exc.message())
            model.clean()
        staged = self.store / name
        if staged.exists():
            _remove_tree(staged)

    def is_alive(self) -> bool:
        """The tritonserver process runs. (PyTriton's public is_alive also requires every bound model's proxy to
        be up, which is false for a moment while an LLM model is re-bound: poll mode's reload read as a crash.)"""
        return self._triton is not None and self._triton._is_alive_impl()

    def stop(self) -> None:
        """Unload and stop Triton, then remove the workspace (staged symlinks first, never their targets)."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._triton is not None:
            staged = list(self.store.iterdir()) if self.store.is_dir() else []  # gone if Triton died first
            for entry in staged:
                if entry.is_symlink() or entry.is_dir():
                    _unlink_staged(entry)
            self._triton.stop()
            self._triton = None
        if self._workspace.path.exists():
            _remove_tree(self._workspace.path)


def _unlink_staged(folder: Path) -> None:
    """Drop the symlinks Strata staged under a model folder so that no cleanup can follow them."""
    if folder.is_symlink():
        folder.unlink()
        return
    for entry in folder.rglob("*"):
        if entry.is_symlink():
            entry.unlink()
