"""Transports for tests and for hosts that drive the engine themselves."""

from __future__ import annotations


class NullTransport:
    """Sends nothing: jobs wait in the table until a worker or a tick asks for them."""

    def wake_workers(self, jobs: int, queue: str = "default") -> None:
        return None

    def wake_claimer(self) -> None:
        return None

    def wake_ticker(self) -> None:
        return None


class RecordingTransport(NullTransport):
    """Counts wake-ups (tests assert that commits, and only commits, wake workers);
    ``wakeups_by_queue`` counts the worker wake-ups per queue (stage routing).
    """

    def __init__(self) -> None:
        self.worker_wakeups = 0
        self.claimer_wakeups = 0
        self.ticker_wakeups = 0
        self.wakeups_by_queue: dict[str, int] = {}

    def wake_workers(self, jobs: int, queue: str = "default") -> None:
        self.worker_wakeups += jobs
        self.wakeups_by_queue[queue] = self.wakeups_by_queue.get(queue, 0) + jobs

    def wake_claimer(self) -> None:
        self.claimer_wakeups += 1

    def wake_ticker(self) -> None:
        self.ticker_wakeups += 1
