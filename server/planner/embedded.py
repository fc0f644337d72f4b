"""`strata serve --planner MODEL`: the SLA planner inside the server, on one thread.

It reads the frontend's series from the server's own registry (no scrape), tunes the model's conditional-
disaggregation thresholds directly (its `DisaggRule`), and scales `strata worker` processes on this host through
the local connector; those register in the server's Redis (`--accept-remote-workers --redis-url`), where the
planner's lease lives too. The model is planned as it was served at start: disaggregated (prefill and decode
workers) when its engine has a `disagg` rule, else aggregated. The planner's series join the server's /metrics.

When the server stops, the planner stops first, and the workers it started are stopped after the model's engine
has let them go.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from server.engine.api import Engine
from server.options import ServeOptions
from server.planner.cli import planner_config
from server.planner.local import LocalConnector, RedisLeadership
from server.planner.metrics import PlannerMetrics
from server.planner.observe import RegistrySource
from server.planner.planner import Planner


class EmbeddedPlanner:
    def __init__(self, planner: Planner, connector: LocalConnector) -> None:
        self.planner = planner
        self.connector = connector
        self._stop = threading.Event()
        self._thread = threading.Thread(target=planner.run, args=(self._stop,), name="planner", daemon=True)

    @classmethod
    def start(
        cls, options: ServeOptions, engines: Mapping[str, Engine], registry: CollectorRegistry
    ) -> EmbeddedPlanner:
        """Plan `options.planner` from now on (serve's flag checks already required --accept-remote-workers);
        ValueError names the flag at fault."""
        model = options.planner
        engine = engines.get(model)
        if engine is None:
            raise ValueError(
                f"--planner {model}: no LLM model of that name is served (served: {sorted(engines)})"
            )
        disagg = getattr(engine, "disagg", None)
        config, profile = planner_config(options.sla, model, options.planner_profile, disagg is not None)
        worker_args = shlex.split(options.planner_worker_args)
        if options.cluster_secret_file is not None:
            worker_args += ["--cluster-secret-file", str(options.cluster_secret_file)]
        repository = next(r for r in options.model_repository if (r / model).is_dir())
        connector = LocalConnector(repository, model, options.redis_url, worker_args,
                                   exit_timeout_s=options.exit_timeout_secs)  # fmt: skip
        leadership = RedisLeadership(options.redis_url, model, lease_s=3 * config.interval_s)
        planner = Planner(config, profile, RegistrySource(registry), connector, PlannerMetrics.create(registry),
                          leadership, disagg)  # fmt: skip
        embedded = cls(planner, connector)
        embedded._thread.start()
        return embedded

    def stop(self) -> None:
        """Stop deciding (the lease is given up); the workers keep running until `stop_workers`."""
        self._stop.set()
        self._thread.join(timeout=10)

    def stop_workers(self) -> None:
        self.connector.close(stop_workers=True)
