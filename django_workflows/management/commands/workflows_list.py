"""``manage.py workflows_list [--json]``: the registered workflows and their execution groups.

::

    package-report  Installed package report
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


def workflow_document(workflow: Workflow) -> dict[str, Any]:
    """The JSON description of one workflow (``workflows_list --json``)."""
    return {
        "id": workflow.id,
        "name": workflow.name,
        "description": workflow.description,
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
        if opts["json"]:
            document = {"workflows": [workflow_document(wf) for wf in workflows]}
            self.stdout.write(json.dumps(document, indent=2, default=str))
            return
        if not workflows:
            self.stdout.write("no workflows registered")
            return
        for index, workflow in enumerate(workflows):
            if index:
                self.stdout.write("")
            self._write_workflow(workflow)

    def _write_workflow(self, workflow: Workflow) -> None:
        write = self.stdout.write
        write(f"{workflow.id}  {workflow.name}")
        if workflow.description:
            write(f"  {workflow.description}")
        write("  " + " -> ".join(workflow.describe_groups()))
        width = max(len(node.stage.id) for node in workflow.nodes)
        for node in workflow.nodes:
            st = node.stage
            limits = timeouts.text(st)
            line = f"    {node.execution_group:>2}  {st.id:<{width}}  {st.mode:<11}  {st.name}"
            write(f"{line}  ({limits})" if limits else line)
