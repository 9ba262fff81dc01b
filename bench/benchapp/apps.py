"""App config of the benchmark app."""

from __future__ import annotations

from django.apps import AppConfig


class BenchAppConfig(AppConfig):
    name = "bench.benchapp"
    label = "benchapp"
    verbose_name = "Benchmark workflows"
