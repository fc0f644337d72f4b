"""Reading a Strata /metrics page (Prometheus text format) the way a benchmark does: the samples of one series."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample named `name` (with its suffix: `..._total`, `..._sum`) on the page."""
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def scrape(url: str) -> str:
    """The /metrics page of the server at `url` (the OpenAI frontend's, which carries every series)."""
    return httpx.get(f"{url}/metrics", timeout=10).text
