"""``manage.py workflows_list [--json]``: the registered workflows, their execution groups and
definition versions (issue 12 item 3: the loaded version, the versions it takes over, and the
in-flight runs per version; one ``GROUP BY`` query, none if the tables do not exist yet).
A version the loaded definition does not run is checked against the worker presence table
(one more query): a live worker that runs it is named (a side-by-side deploy), else the runs
are orphaned until a worker with that version comes back.

::

    package-report  Installed package report
      version: fp-3f1c2a9b0d4e5f67 (fingerprint); in flight: fp-3f1c2a9b0d4e5f67 2 runs,
               fp-0a1b2c3d4e5f6a7b 1 run (live worker worker-old-host-4711-1a2b3c runs it),
               fp-9e8d7c6b5a4f3e2d 1 run (no loaded definition or live worker runs it)
      discover -> [parse-metadata | text-stats] -> dependency-graph -> report
        1  discover          sync         Discover installed distributions
        2  parse-metadata    sync         Parse metadata headers
        ...

A stage with a timeout (its own or ``DEFAULT_STAGE_TIMEOUT_SECONDS``) shows it after its
name, e.g. ``(timeout 600 s, queue wait 60 s)``; ``--json`` gives each stage's ``queue``,
``timeout_seconds`` and ``queue_timeout_seconds`` (effective values, ``null``: none).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_workflows.definition.registry import registry
from django_workflows.definition.workflow import Workflow
from django_workflows.kernel import timeouts
from django_workflows.kernel.versions import describe_workers


def _runnable(workflow: Workflow, version: str) -> bool:
    """Whether the loaded ``workflow`` runs runs of ``version`` (``""``: unversioned, any)."""
    return not version or version in workflow.runs_versions


def live_workers_by_version() -> dict[tuple[str, str], list[str]]:
    """:func:`django_workflows.kernel.versions.live_workers` (``{(workflow_id, version):
    [worker_id, ...]}``), or ``{}`` when the presence table cannot be read."""
    from django.db import DatabaseError, transaction

    from django_workflows.kernel.runtime import get_kernel
    from django_workflows.kernel.versions import live_workers

    try:
        with transaction.atomic():
            return live_workers(lease_clock=get_kernel().lease_clock)
    except DatabaseError:
        return {}


def in_flight_by_workflow() -> dict[str, dict[str, int]]:
    """``{workflow_id: {definition_version: in-flight runs}}`` (``""``: unversioned); ``{}``
    when the runs table cannot be read (before ``migrate``).
    """
    from django.db import DatabaseError, transaction

    from django_workflows.kernel.versions import in_flight_versions

    try:
        with transaction.atomic():
            counts = in_flight_versions()
    except DatabaseError:
        return {}
    found: dict[str, dict[str, int]] = {}
    for (workflow_id, version), runs in sorted(counts.items()):
        found.setdefault(workflow_id, {})[version] = runs
    return found


def workflow_document(
    workflow: Workflow,
    in_flight: dict[str, int] | None = None,
    live: dict[tuple[str, str], list[str]] | None = None,
) -> dict[str, Any]:
    """The JSON description of one workflow (``workflows_list --json``); ``in_flight``: its
    PENDING/RUNNING runs per definition version (:func:`in_flight_by_workflow`), each with
    ``runnable`` (the loaded definition runs it), ``live_workers`` (the ids of the live
    workers that advertise it, :func:`live_workers_by_version`) and ``orphaned`` (neither).
    """
    live = live or {}
    return {
        "id": workflow.id,
        "name": workflow.name,
        "description": workflow.description,
        "version": workflow.version,
        "version_is_explicit": workflow.version_is_explicit,
        "takes_over": list(workflow.takes_over),
        "in_flight": [
            {
                "version": version,
                "runs": runs,
                "runnable": _runnable(workflow, version),
                "live_workers": live.get((workflow.id, version), []),
                "orphaned": not _runnable(workflow, version)
                and not live.get((workflow.id, version)),
            }
            for version, runs in sorted((in_flight or {}).items())
        ],
        "groups": workflow.describe_groups(),
        "stages": [
            {
                "id": node.stage.id,
                "name": node.stage.name,
                "mode": node.stage.mode,
                "execution_group": node.execution_group,
                "stage_number": node.stage_number,
                "dependencies": list(node.stage.dependencies),
                "default_config": node.stage.default_config,
                "queue": node.stage.queue,
                **timeouts.describe(node.stage),
            }
            for node in workflow.nodes
        ],
    }


class Command(BaseCommand):
    help = (
        "List the registered workflows with their execution groups (stages of one group run in "
        "parallel), stage modes (sync / async-batch) and names. --json prints a JSON document."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print a JSON document")

    def handle(self, *args: Any, **opts: Any) -> None:
        workflows = list(registry)
        in_flight = in_flight_by_workflow()
        live = (
            live_workers_by_version()
            if any(
                not _runnable(wf, version)
                for wf in workflows
                for version in in_flight.get(wf.id, {})
            )
            else {}
        )
        if opts["json"]:
            document = {
                "workflows": [workflow_document(wf, in_flight.get(wf.id), live) for wf in workflows]
            }
            self.stdout.write(json.dumps(document, indent=2, default=str))
            return
        if not workflows:
            self.stdout.write("no workflows registered")
            return
        for index, workflow in enumerate(workflows):
            if index:
                self.stdout.write("")
            self._write_workflow(workflow, in_flight.get(workflow.id) or {}, live)

    def _write_workflow(
        self,
        workflow: Workflow,
        in_flight: dict[str, int],
        live: dict[tuple[str, str], list[str]],
    ) -> None:
        write = self.stdout.write
        write(f"{workflow.id}  {workflow.name}")
        if workflow.description:
            write(f"  {workflow.description}")
        kind = "explicit" if workflow.version_is_explicit else "fingerprint"
        line = f"  version: {workflow.version} ({kind})"
        if workflow.takes_over:
            line += f"; takes over {', '.join(workflow.takes_over)}"
        counts = []
        for version, runs in sorted(in_flight.items()):
            label = version or "(unversioned)"
            text = f"{label} {runs} run{'s' if runs != 1 else ''}"
            if not _runnable(workflow, version):
                workers = live.get((workflow.id, version))
                if workers:
                    verb = "runs" if len(workers) == 1 else "run"
                    text += f" (live {describe_workers(workers)} {verb} it)"
                else:
                    text += " (no loaded definition or live worker runs it)"
            counts.append(text)
        line += "; in flight: " + (", ".join(counts) if counts else "none")
        write(line)
        write("  " + " -> ".join(workflow.describe_groups()))
        width = max(len(node.stage.id) for node in workflow.nodes)
        for node in workflow.nodes:
            st = node.stage
            limits = timeouts.text(st)
            line = f"    {node.execution_group:>2}  {st.id:<{width}}  {st.mode:<11}  {st.name}"
            write(f"{line}  ({limits})" if limits else line)
