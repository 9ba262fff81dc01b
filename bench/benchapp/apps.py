"""App config of the benchmark app."""

from __future__ import annotations

from django.apps import AppConfig


class BenchAppConfig(AppConfig):
    name = "bench.benchapp"
    label = "benchapp"
    verbose_name = "Benchmark workflows"

    def ready(self) -> None:
        # per-process statement counter of a whole cluster (only with BENCH_SQL_COUNT_DIR)
        from .sqlcount import install

        install()
