"""What tests/ and bench/ share: `strata serve` and Redis started on free ports, waiting on a condition with a
deadline, the Mooncake trace, one percentile, OpenAI client load, and the pure parts of benchmarks that tests
check. Not installed with the product; `server` and `kvbm` never import it, and it imports neither `bench` nor
`tests` (contracts in pyproject.toml, checked by tests/test_architecture.py)."""
