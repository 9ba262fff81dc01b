"""Fixtures of the HTTP API tests: workflows in the global registry (the API reads it), users
with chosen permissions, token-authenticated clients and helpers that drive runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.cache import cache
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_workflows import define_stage, define_workflow
from django_workflows.approval import approval_stage
from django_workflows.definition.registry import registry
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.kernel.runtime import get_kernel
from django_workflows.models import (
    IdempotencyKey,
    OutboxEvent,
    WorkflowAnnotation,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from tests.workflows import Num, add

API = "/api/workflows/"

#: Every permission the API checks, by codename.
ALL_PERMS = (
    "view_workflowrun",
    "add_workflowrun",
    "cancel_workflowrun",
    "rerun_workflowrun",
    "approve_workflowrun",
    "annotate_workflowrun",
    "view_workflowannotation",
    "view_outboxevent",
    "view_workflowlog",
    "view_workflowsignal",
    "add_workflowsignal",
)


def _explode(ctx: Any) -> Num:
    raise ValueError("boom")


def api_workflows() -> list[Any]:
    def log_and_add(ctx: Any) -> Num:
        ctx.log("INFO", "adding one", value=ctx.input.value)
        ctx.progress(50, "half way")
        return Num(value=ctx.input.value + 1)

    first = define_stage(id="first", input=Num, output=Num, execute=log_and_add)
    return [
        define_workflow(id="api-two-stage", name="API demo", input=Num)
        .pipe(first)
        .pipe(add(10, stage_id="second"))
        .build(),
        define_workflow(id="api-approval", input=Num)
        .pipe(add(1, stage_id="draft"))
        .pipe(approval_stage(id="review", poll_interval_seconds=0.01, allowed_approvers=None))
        .build(),
        define_workflow(id="api-approval-restricted", input=Num)
        .pipe(approval_stage(id="review", poll_interval_seconds=0.01, allowed_approvers=["bob"]))
        .build(),
        define_workflow(id="api-fails").pipe(define_stage(id="explode", execute=_explode)).build(),
    ]


@pytest.fixture(autouse=True)
def _api_settings(_test_settings: None, settings: Any) -> None:
    """One delivery per job: a failing stage fails its run at once (no back-off waits)."""
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "MAX_ATTEMPTS": 1}


@pytest.fixture(autouse=True)
def workflows() -> Iterator[list[Any]]:
    wfs = api_workflows()
    for wf in wfs:
        registry.register(wf)
    cache.clear()  # throttle counters
    yield wfs
    for wf in wfs:
        registry.unregister(wf.id)


def make_user(username: str, *codenames: str, superuser: bool = False) -> User:
    user = User.objects.create_user(username=username, password="pw", is_superuser=superuser)
    if codenames:
        user.user_permissions.add(
            *Permission.objects.filter(
                content_type__app_label="django_workflows", codename__in=codenames
            )
        )
    return user


def token_client(user: User | None) -> APIClient:
    client = APIClient()
    if user is not None:
        token, _ = Token.objects.get_or_create(user=user)
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@pytest.fixture
def client_with(db: Any) -> Callable[..., APIClient]:
    """``client_with("view_workflowrun", ...)``: a token client of a user with those perms."""
    counter = {"n": 0}

    def build(*codenames: str, username: str | None = None) -> APIClient:
        counter["n"] += 1
        return token_client(make_user(username or f"user{counter['n']}", *codenames))

    return build


@pytest.fixture
def api(client_with: Callable[..., APIClient]) -> APIClient:
    """A client with every API permission (user ``alice``)."""
    return client_with(*ALL_PERMS, username="alice")


def drive(run_id: Any, rounds: int = 20) -> WorkflowRun:
    """Tick and execute jobs with the default kernel until the run is terminal or stalls."""
    kernel = get_kernel()
    for _ in range(rounds):
        run_maintenance_tick(kernel, "api-test")
        processed = process_available_jobs(kernel, "api-test", max_jobs=50).processed
        run = WorkflowRun.objects.get(pk=run_id)
        if run.is_terminal:
            run_maintenance_tick(kernel, "api-test")
            return run
        if not processed and WorkflowStage.objects.filter(run=run, status="SUSPENDED").exists():
            return run
    return WorkflowRun.objects.get(pk=run_id)


def row_counts() -> dict[str, int]:
    return {
        m.__name__: m.objects.count()
        for m in (
            WorkflowRun,
            WorkflowStage,
            WorkflowJob,
            WorkflowLog,
            WorkflowAnnotation,
            OutboxEvent,
            IdempotencyKey,
        )
    }
