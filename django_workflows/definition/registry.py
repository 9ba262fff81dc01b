"""The workflow registry: ``workflow_id -> Workflow`` (K-1 ``registry``).

Apps register their workflows in a ``workflows`` module, which the app config imports at start-up
(autodiscovery)::

    # myapp/workflows.py
    from django_workflows import register
    register(my_workflow)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, overload

from .stage import WorkflowDefinitionError
from .workflow import Workflow

if TYPE_CHECKING:
    from .schedule import ScheduleDefinition


class WorkflowRegistry:
    """A mapping of workflow ids to built workflows, and of schedule names to schedule
    definitions (:func:`~django_workflows.define_schedule`)."""

    def __init__(self) -> None:
        self._workflows: dict[str, Workflow] = {}
        self._schedules: dict[str, ScheduleDefinition] = {}
        self._runnable: tuple[tuple[str, str], ...] | None = None

    def register_schedule(self, schedule: ScheduleDefinition) -> ScheduleDefinition:
        """Add ``schedule`` (replacing a definition of the same name) and return it. Its input
        and config are checked against its workflow when that is registered already.

        Raises:
            WorkflowDefinitionError: ``schedule`` is not a :class:`ScheduleDefinition`.
            ScheduleDefinitionError: input or config invalid for the registered workflow.
        """
        from .schedule import ScheduleDefinition, check_against_workflow

        if not isinstance(schedule, ScheduleDefinition):
            raise WorkflowDefinitionError(
                f"register_schedule() expects a ScheduleDefinition, got {schedule!r}"
            )
        workflow = self._workflows.get(schedule.workflow_id)
        if workflow is not None:
            check_against_workflow(schedule, workflow)
        self._schedules[schedule.name] = schedule
        return schedule

    def unregister_schedule(self, name: str) -> None:
        self._schedules.pop(name, None)

    def get_schedule(self, name: str) -> ScheduleDefinition | None:
        """The schedule definition named ``name`` or ``None``."""
        return self._schedules.get(name)

    def schedules(self) -> list[ScheduleDefinition]:
        """The registered schedule definitions, by name."""
        return [self._schedules[name] for name in sorted(self._schedules)]

    def schedule_names(self) -> list[str]:
        """The names of the registered schedule definitions, sorted."""
        return sorted(self._schedules)

    def register(self, workflow: Workflow) -> Workflow:
        """Add ``workflow`` and return it (so it can be used as an expression).

        Raises:
            WorkflowDefinitionError: ``workflow`` is not a built :class:`Workflow`, or another
                workflow already uses its id.
            ScheduleDefinitionError: a schedule registered earlier for this workflow has an
                input or config that does not fit it (so the outcome does not depend on which
                module was imported first; nothing is registered).
        """
        if not isinstance(workflow, Workflow):
            raise WorkflowDefinitionError(
                f"register() expects a built Workflow (call .build()), got {workflow!r}"
            )
        existing = self._workflows.get(workflow.id)
        if existing is not None and existing is not workflow:
            raise WorkflowDefinitionError(
                f"A workflow with id {workflow.id!r} is already registered"
            )
        if self._schedules:
            from .schedule import check_against_workflow

            for schedule in self.schedules():
                if schedule.workflow_id == workflow.id:
                    check_against_workflow(schedule, workflow)
        self._workflows[workflow.id] = workflow
        self._runnable = None
        return workflow

    def unregister(self, workflow_id: str) -> None:
        self._workflows.pop(workflow_id, None)
        self._runnable = None

    def runnable_versions(self) -> tuple[tuple[str, str], ...]:
        """``((workflow_id, version), ...)`` sorted: every definition version whose runs this
        registry's workflows execute (each one's own version and its ``takes_over``; issue 12
        item 3). Workers lease only jobs and PENDING runs of these (or unversioned ones).
        Cached until the registry changes.
        """
        found = self._runnable
        if found is None:
            found = self._runnable = tuple(
                sorted((wf.id, v) for wf in self._workflows.values() for v in wf.runs_versions)
            )
        return found

    def get(self, workflow_id: str) -> Workflow | None:
        """The workflow with ``workflow_id`` or ``None``."""
        return self._workflows.get(workflow_id)

    def workflow_ids(self) -> list[str]:
        """The registered workflow ids, sorted (for "did you mean" messages)."""
        return sorted(self._workflows)

    def __contains__(self, workflow_id: object) -> bool:
        return workflow_id in self._workflows

    def __iter__(self) -> Iterator[Workflow]:
        return iter(sorted(self._workflows.values(), key=lambda w: w.id))

    def __len__(self) -> int:
        return len(self._workflows)

    def clear(self) -> None:
        self._workflows.clear()
        self._schedules.clear()
        self._runnable = None


#: The process-wide registry filled by autodiscovery.
registry = WorkflowRegistry()


@overload
def register(workflow: Workflow) -> Workflow: ...
@overload
def register(workflow: ScheduleDefinition) -> ScheduleDefinition: ...
def register(workflow: Workflow | ScheduleDefinition) -> Workflow | ScheduleDefinition:
    """Register a workflow (:meth:`WorkflowRegistry.register`) or a schedule
    (:meth:`WorkflowRegistry.register_schedule`) in the default registry.
    """
    from .schedule import ScheduleDefinition

    if isinstance(workflow, ScheduleDefinition):
        return registry.register_schedule(workflow)
    return registry.register(workflow)
