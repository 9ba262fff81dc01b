"""``manage.py workflows_signal <run_id> <name> [--payload JSON] [--key K] [--actor A]``: send
a signal to a run (``run.signal``, docs/signals.md).

Prints ``stored signal <id>`` (``woke a waiting stage`` when one waited for it), or
``duplicate: key <K> was already used for signal <id>`` (nothing written, exit status 0).
A malformed run id, name, payload or key, an unknown run and a finished run are errors (exit
status 1, nothing written).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_workflows.kernel.errors import WorkflowError
from django_workflows.kernel.jsonvalue import loads_json

from ._common import parse_run_id_argument


class Command(BaseCommand):
    help = (
        "Send signal NAME (with an optional JSON payload) to a workflow run; a wait_for_signal "
        "stage of the run consumes it. --key makes a repeat a no-op."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_id", help="the run's id (a UUID)")
        parser.add_argument("name", help="the signal name (letters, digits, '._:-')")
        parser.add_argument(
            "--payload", default=None, help="the payload as JSON (default: null), at most 64 KiB"
        )
        parser.add_argument(
            "--key", default=None, help="idempotency key, unique per run: a repeat stores nothing"
        )
        parser.add_argument(
            "--actor", default=None, help="who sends it (default: cli:<the OS user>)"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        from django_workflows.signals import send_signal

        run_id = parse_run_id_argument(opts["run_id"])
        payload: Any = None
        if opts["payload"] is not None:
            try:
                payload = loads_json(opts["payload"])
            except ValueError as exc:
                raise CommandError(f"--payload: not JSON: {exc}") from None
        actor = opts["actor"] or _default_actor()
        try:
            result = send_signal(run_id, opts["name"], payload, key=opts["key"], actor=actor)
        except WorkflowError as exc:
            field = getattr(exc, "field", None)
            option = {"payload": "--payload", "key": "--key", "actor": "--actor"}.get(field or "")
            message = str(exc)
            if option and message.startswith(f"{field}: "):
                message = f"{option}: {message.removeprefix(f'{field}: ')}"
            raise CommandError(message) from None
        if not result.stored:
            self.stdout.write(
                f"duplicate: key {opts['key']!r} was already used for signal {result.signal_id}"
            )
            return
        woke = " (woke a waiting stage)" if result.woke else ""
        self.stdout.write(self.style.SUCCESS(f"stored signal {result.signal_id}{woke}"))


def _default_actor() -> str:
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # no user name in this environment
        return "cli"
