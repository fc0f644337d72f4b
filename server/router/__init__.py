"""KV-aware request router: picks the worker whose cache and load make a request cheapest to serve."""
