"""`python -m kvbm --redis-url redis://host:6379/0`: the standalone KVBM service (what `strata kvbm` runs)."""

from __future__ import annotations

import argparse
import logging

from kvbm.service import DEFAULT_PORT, run_service


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="kvbm", description="KVBM service: block index fed by worker events"
    )
    parser.add_argument("--redis-url", required=True, help="Redis holding the event stream and worker leases")
    parser.add_argument("--host", default="127.0.0.1", help="query listen address")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="query listen port (TCP)")
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus /metrics port (off if unset)"
    )
    parser.add_argument(
        "--lease-check-secs", type=float, default=0.5, help="how often dead workers are expired"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_service(args.redis_url, args.host, args.port, args.metrics_port, lease_check_s=args.lease_check_secs)


if __name__ == "__main__":
    main()
