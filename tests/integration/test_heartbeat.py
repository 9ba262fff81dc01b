"""Heartbeats: lease refresh (H-2, DM-46) and cancellation seen by a running stage (Part I 15)."""

from __future__ import annotations

from typing import Any

import pytest

from django_workflows.kernel import CancelRun, ClaimPendingRuns, CreateRun
from django_workflows.kernel.hosting import Heartbeat
from django_workflows.kernel.services import KernelStageServices
from django_workflows.models import Status, WorkflowJob
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)


def test_heartbeat_refreshes_lease_and_reports_cancel_to_the_stage(kernel_for: Any, clock) -> None:
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("w"))
    job = kernel.queue.dequeue("w")
    assert job is not None
    leased_at = job.locked_at
    services = KernelStageServices(
        clock=clock,
        blobs=kernel.blobs,
        workflow_type="two-stage",
        run_id=job.workflow_run_id,
        stage_id=job.stage_id,
        stage_pk=None,
        cancel_check_interval_seconds=3600,
    )
    assert services.is_cancelled() is False  # read once; the next read is an hour away

    clock.advance(30)
    with Heartbeat(kernel, job.pk, interval_seconds=3600, run_id=job.workflow_run_id) as hb:
        hb.beat()
        assert WorkflowJob.objects.get(pk=job.pk).locked_at > leased_at
        assert services.is_cancelled() is False

        kernel.dispatch(CancelRun(run_id))
        assert services.is_cancelled() is False  # the throttled read has not come round yet
        hb.beat()
        assert services.is_cancelled() is True  # the heartbeat saw the cancel
    assert WorkflowJob.objects.get(pk=job.pk).status == Status.RUNNING  # K-CA-3
