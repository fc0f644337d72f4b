"""The standalone KVBM service's command line: `python -m kvbm` and `strata kvbm` both build it from here, so the
flags are defined once and kvbm needs nothing of `server` to run. Cheap to import (`strata --help` builds it)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from cluster.curve import CurveKeys

DEFAULT_PORT = 7410  # the service's prefix-query port


class ServiceOptions(msgspec.Struct, frozen=True):
    """The service's parsed flags (each field's name is its flag's dest); seconds unless the name says."""

    redis_url: str
    host: str
    port: int
    metrics_port: int | None
    lease_check_secs: float
    cluster_secret_file: Path | None


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    """The service's flags, on `parser` (a subcommand's parser, or the one of `python -m kvbm`)."""
    parser.add_argument("--redis-url", required=True, help="Redis holding the event stream and worker leases")
    parser.add_argument("--host", default="127.0.0.1", help="address of the prefix-query port")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="prefix-query port (routers connect here)"
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics of the service")
    parser.add_argument(
        "--lease-check-secs", type=float, default=0.5, help="how often dead workers are dropped"
    )
    parser.add_argument(
        "--cluster-secret-file",
        type=Path,
        default=None,
        help="the cluster secret routers must prove on the query port (default: $STRATA_CLUSTER_SECRET)",
    )


def service_options(args: argparse.Namespace) -> ServiceOptions:
    """The typed options of the flags `add_service_flags` defined, once parsed."""
    return msgspec.convert(args, ServiceOptions, from_attributes=True)


def query_port_keys(options: ServiceOptions) -> CurveKeys:
    """The query port's CURVE keys, from --cluster-secret-file or STRATA_CLUSTER_SECRET (kvbm's own CLI reads its
    environment here: the package runs without `server`); ValueError saying how to make a secret if neither."""
    from cluster.secret import load_secret
    from kvbm.wire import service_keys

    secret = load_secret(
        options.cluster_secret_file, os.environ.get("STRATA_CLUSTER_SECRET"), "the KVBM service"
    )
    return service_keys(secret)


def run(options: ServiceOptions) -> None:
    """Run the service the flags describe until SIGINT/SIGTERM."""
    from kvbm.service import run_service

    run_service(
        options.redis_url,
        options.host,
        options.port,
        options.metrics_port,
        lease_check_s=options.lease_check_secs,
        keys=query_port_keys(options),
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m kvbm`."""
    parser = argparse.ArgumentParser(
        prog="kvbm", description="KVBM service: block index fed by worker events"
    )
    add_service_flags(parser)
    options = service_options(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(options)
    except ValueError as exc:
        parser.exit(2, f"kvbm: {exc}\n")
