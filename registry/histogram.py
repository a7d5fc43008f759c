"""A cumulative histogram, sans I/O: what an actor counts for `/metrics` (service/metrics.py
renders it as a Prometheus histogram) without importing the metrics library."""

from __future__ import annotations

from collections.abc import Sequence


class Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.buckets = dict.fromkeys((float(b) for b in bounds), 0)  # bound → values ≤ it
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for bound in self.buckets:
            if value <= bound:
                self.buckets[bound] += 1
        self.sum += value
        self.count += 1
