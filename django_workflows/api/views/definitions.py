"""``GET definitions/`` and ``GET definitions/{workflow_id}/``: registered workflows."""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response

from ...definition.registry import registry
from ...kernel import timeouts
from .. import serializers as s
from ..errors import APIError
from .base import (
    WorkflowsAPIView,
    _errors,
    document,
)


def _json_schema(model: Any) -> Any:
    try:
        return model.model_json_schema()
    except Exception as exc:  # a model pydantic cannot describe (arbitrary types)
        return {"description": f"no JSON Schema available: {type(exc).__name__}"}


def definition_document(workflow: Any) -> dict[str, Any]:
    """A registered workflow: input schema and execution groups with stage config schemas."""
    groups = []
    for index, group in enumerate(workflow.execution_plan, start=1):
        groups.append(
            {
                "execution_group": index,
                "parallel": len(group) > 1,
                "stages": [
                    {
                        "stage_id": node.stage.id,
                        "name": node.stage.name,
                        "description": node.stage.description or "",
                        "mode": node.stage.mode,
                        "dependencies": list(node.stage.dependencies),
                        "config_schema": _json_schema(node.stage.config_model),
                        "config_defaults": node.stage.default_config,
                        "output_schema": _json_schema(node.stage.output_model)
                        if node.stage.output_model is not None
                        else None,
                        **timeouts.describe(node.stage),
                        "when": node.when.structure() if node.when is not None else None,
                        "branch": node.branch.structure() if node.branch is not None else None,
                    }
                    for node in group
                ],
            }
        )
    return {
        "workflow_id": workflow.id,
        "name": workflow.name,
        "description": workflow.description or "",
        "input_schema": _json_schema(workflow.input_model),
        "execution_groups": groups,
    }


# --- definitions -------------------------------------------------------------------------------


class DefinitionListView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowrun"]}

    @document(
        operation_id="definitions_list",
        summary="Registered workflows",
        responses={200: s.DefinitionSerializer(many=True), **_errors()},
    )
    def get(self, request: Request) -> Response:
        data = [definition_document(wf) for wf in registry]
        return Response(s.DefinitionSerializer(data, many=True).data)


class DefinitionDetailView(WorkflowsAPIView):
    required_permissions = {"GET": ["view_workflowrun"]}

    @document(
        operation_id="definitions_retrieve",
        summary="One registered workflow",
        responses={200: s.DefinitionSerializer, **_errors(404)},
    )
    def get(self, request: Request, workflow_id: str) -> Response:
        workflow = registry.get(workflow_id)
        if workflow is None:
            raise APIError(
                f"Workflow {workflow_id[:200]!r} is not registered.",
                code="not_found",
                status_code=404,
            )
        return Response(s.DefinitionSerializer(definition_document(workflow)).data)


# --- runs ---------------------------------------------------------------------------------------
