"""The stage path's modules, in the order of the story told by :mod:`..delivery`.

* :mod:`.lease` - step 1, transaction 1: lease a job (or claim a run), start its stage;
* :mod:`.execute` - step 2, no transaction: run the stage body under the heartbeat
  (:mod:`..heartbeat`);
* :mod:`.outcome` - step 3, transaction 3: the fence, the outcome, the transition;
* :mod:`.records` - the stage record's writes of steps 1 and 3 (start, outcome) and the call
  into the executor of step 2;
* :mod:`.transition` - the run's transition rules (K-TR-1..9), applied in transaction 3.

This package holds what they share: :class:`Delivery` (the token and what step 2 needs) and
:class:`Outcome` (how a delivery ended) and :class:`_Discard`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ...definition.workflow import StageNode, Workflow
from ...models import WorkflowJob, WorkflowRun, WorkflowStage
from ..outbox import new_causation_id


@dataclass
class Delivery:
    """A leased job and everything its execution needs, read in the lease transaction.

    ``job.attempt`` is the delivery's fencing token. ``records`` are the run's stage records
    as of the lease; ``outputs`` the raw outputs (``{stage_id: output}``) of the earlier
    groups' COMPLETED records.
    """

    job: WorkflowJob
    workflow: Workflow
    node: StageNode
    run: WorkflowRun
    record: WorkflowStage
    records: list[WorkflowStage]
    outputs: dict[str, Any]
    resume_state: Any
    started_at: datetime
    #: The delivery's one causation id: its ``stage:started`` and its outcome's events carry
    #: it (SPEC K-5, K-JE-2).
    causation_id: str = field(default_factory=new_causation_id)
    #: When the lease's statements were done (``time.time_ns()``, set as the delivery is
    #: made), and when the lease transaction began (set by :func:`.lease.lease` and
    #: :func:`.lease.lease_job`; ``None`` for a lease folded into an outcome's commit): the
    #: ``workflow.lease`` span of :mod:`django_workflows.telemetry`.
    leased_ns: int = field(default_factory=time.time_ns)
    lease_began_ns: int | None = None


@dataclass
class Outcome:
    """How a delivery ended: ``completed``, ``suspended``, ``failed`` (``retrying`` when the
    job went back to the queue), ``ghost`` (the run left RUNNING) or ``discarded`` (the lease
    was taken over). ``next`` is the delivery this worker leased in the same transaction;
    ``no_work`` is true when that transaction looked for one and found nothing (issue 19: the
    worker need not look again at once).
    """

    outcome: str
    error: str | None = None
    retrying: bool = False
    next: Delivery | None = None
    #: What the outcome transaction wrote for the stage (an ``ExecuteJobResult``: its output,
    #: ``next_poll_at``, ``retryable``); ``None`` for a ghost, a discarded delivery, or an
    #: outcome found committed after a lost acknowledgement.
    result: Any = None
    no_work: bool = False


class _Discard(Exception):
    """Raised inside the outcome transaction to roll it back: the token no longer owns the job."""
