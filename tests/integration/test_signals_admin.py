"""The admin's signals (issue 18 item 4): the "Send signal" operation on the run page
(permission-gated: add_workflowsignal + view_workflowsignal; CSRF-protected; confirmation page
on GET, nothing written), the run's signals listed on its page, and the read-only signal list.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from django_workflows import define_workflow, wait_for_signal
from django_workflows.definition.registry import registry
from django_workflows.kernel import CancelRun, CreateRun, Kernel
from django_workflows.models import Status, WorkflowRun, WorkflowSignal, WorkflowStage
from django_workflows.testing import FakeClock, drive

pytestmark = pytest.mark.django_db

SIGNAL_PERMS = ("view_workflowrun", "view_workflowsignal", "add_workflowsignal")


@pytest.fixture
def kernel(kernel_for: Callable[..., Kernel]) -> Iterator[Kernel]:
    wf = define_workflow(id="adm-signal").pipe(wait_for_signal(id="approved")).build()
    registry.register(wf)
    yield kernel_for(wf)
    registry.unregister(wf.id)


def _waiting_run(kernel: Kernel) -> str:
    run_id = str(kernel.dispatch(CreateRun(workflow_id="adm-signal")).workflow_run_id)
    drive(kernel, run_id, rounds=3, advance_seconds=0)
    assert WorkflowStage.objects.get(run_id=run_id).status == Status.SUSPENDED
    return run_id


def _staff(django_user_model: Any, name: str, *codenames: str, csrf: bool = False) -> Client:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def _url(run_id: str, name: str = "signal") -> str:
    return reverse(f"admin:django_workflows_workflowrun_{name}", args=[run_id])


def test_send_signal_from_the_run_page(
    kernel: Kernel, clock: FakeClock, django_user_model: Any
) -> None:
    run_id = _waiting_run(kernel)
    client = _staff(django_user_model, "ops", *SIGNAL_PERMS)
    page = client.get(_url(run_id, "change")).content.decode()
    assert _url(run_id) in page and "Send signal" in page
    assert "waiting for signal &#x27;approved&#x27; (no timeout)" in page
    confirm = client.get(_url(run_id))
    assert confirm.status_code == 200
    html = confirm.content.decode()
    assert 'value="approved"' in html  # the waiting signal's name is proposed
    assert not WorkflowSignal.objects.exists()  # GET writes nothing
    bad = client.post(_url(run_id), {"confirm": "yes", "name": "approved", "payload": "{x"})
    assert bad.status_code == 200 and "not JSON" in bad.content.decode()
    assert not WorkflowSignal.objects.exists()
    response = client.post(
        _url(run_id),
        {"confirm": "yes", "name": "approved", "payload": json.dumps({"ok": 1}), "key": "k"},
    )
    assert response.status_code == 302
    messages = [str(m) for m in get_messages(response.wsgi_request)]
    assert any(m.startswith("Stored signal approved") for m in messages), messages
    row = WorkflowSignal.objects.get()
    assert (row.payload, row.actor, row.idempotency_key) == ({"ok": 1}, "user:ops", "k")
    assert "Sent signal approved" in LogEntry.objects.get(object_id=run_id).get_change_message()
    again = client.post(_url(run_id), {"confirm": "yes", "name": "approved", "key": "k"})
    assert any("nothing was stored" in str(m) for m in get_messages(again.wsgi_request))
    assert WorkflowSignal.objects.count() == 1
    page = client.get(_url(run_id, "change")).content.decode()
    assert 'id="dw-signals"' in page and "dw-signal-pending" in page
    run = drive(kernel, run_id, rounds=3)  # the admin's kernel stamped real time: jump to it
    assert run.status == Status.COMPLETED
    page = client.get(_url(run_id, "change")).content.decode()
    assert "by stage approved" in page and "Send signal" not in page
    listing = client.get(reverse("admin:django_workflows_workflowsignal_changelist"))
    assert listing.status_code == 200 and "consumed" in listing.content.decode()
    detail = client.get(reverse("admin:django_workflows_workflowsignal_change", args=[row.pk]))
    assert detail.status_code == 200


def test_the_operation_needs_its_permission_and_csrf(
    kernel: Kernel, clock: FakeClock, django_user_model: Any
) -> None:
    run_id = _waiting_run(kernel)
    anonymous = Client().post(_url(run_id), {"confirm": "yes", "name": "approved"})
    assert anonymous.status_code == 302 and "/login/" in anonymous.url
    for name, perms in [
        ("viewer", ("view_workflowrun",)),
        ("noview", ("view_workflowrun", "add_workflowsignal")),
        ("others", ("view_workflowrun", "view_workflowsignal", "annotate_workflowrun")),
    ]:
        client = _staff(django_user_model, name, *perms)
        assert client.get(_url(run_id)).status_code == 403
        assert client.post(_url(run_id), {"confirm": "yes", "name": "a"}).status_code == 403
        assert "Send signal" not in client.get(_url(run_id, "change")).content.decode()
    csrf = _staff(django_user_model, "csrf", *SIGNAL_PERMS, csrf=True)
    assert csrf.post(_url(run_id), {"confirm": "yes", "name": "approved"}).status_code == 403
    assert not WorkflowSignal.objects.exists()


def test_a_finished_run_takes_no_signal(
    kernel: Kernel, clock: FakeClock, django_user_model: Any
) -> None:
    run_id = _waiting_run(kernel)
    kernel.dispatch(CancelRun(run_id))
    client = _staff(django_user_model, "ops", *SIGNAL_PERMS)
    response = client.get(_url(run_id))
    assert response.status_code == 302
    assert any("takes no signals" in str(m) for m in get_messages(response.wsgi_request))
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED
    assert not WorkflowSignal.objects.exists()
