"""The bare django-q2 peer: a chain of 4 trivial tasks per run, each task enqueueing the next
(``async_task``); the last one inserts one marker row so the driver can count finished chains.

Why not ``django_q.tasks.Chain``: with ``save_limit: -1`` (the cluster configuration the engine
uses) django-q2 only continues a chain from a *saved* task, so ``Chain`` would add a result-row
INSERT per task; self-enqueueing is the leaner, stricter peer.
"""

from __future__ import annotations

CHAIN_LENGTH = 4
MARKER_PREFIX = "bench-chain/"


def chain_step(chain_id: int, step: int) -> None:
    """Step ``step`` (1-based) of chain ``chain_id``: enqueue the next step or mark done."""
    if step < CHAIN_LENGTH:
        from django_q.tasks import async_task

        async_task("bench.benchapp.tasks.chain_step", chain_id, step + 1)
        return
    from django.utils import timezone

    from django_workflows.models import WorkflowBlob

    WorkflowBlob.objects.create(key=f"{MARKER_PREFIX}{chain_id}", created_at=timezone.now(), data=1)
