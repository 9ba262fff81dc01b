"""Display helpers shared by the admin classes: status badges, durations, JSON, run links, and a
read-only base class for the tables the kernel owns.

Nothing here writes: the admin reads models for display and changes state only by dispatching
kernel commands (ARCHITECTURE §2).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import Status

#: Badge colours (background, text) per status; shared by runs, stages and jobs.
STATUS_COLOURS: dict[str, tuple[str, str]] = {
    Status.PENDING: ("#6c757d", "#fff"),
    Status.RUNNING: ("#0d6efd", "#fff"),
    Status.SUSPENDED: ("#b7791f", "#fff"),
    Status.COMPLETED: ("#198754", "#fff"),
    Status.FAILED: ("#dc3545", "#fff"),
    Status.CANCELLED: ("#343a40", "#fff"),
    Status.SKIPPED: ("#adb5bd", "#212529"),
}

#: Badge colours for log levels and outbox delivery states.
TONE_COLOURS: dict[str, tuple[str, str]] = {
    "DEBUG": ("#adb5bd", "#212529"),
    "INFO": ("#0dcaf0", "#052c65"),
    "WARN": ("#ffc107", "#212529"),
    "ERROR": ("#dc3545", "#fff"),
    "published": ("#198754", "#fff"),
    "pending": ("#6c757d", "#fff"),
    "retrying": ("#b7791f", "#fff"),
    "dead-lettered": ("#dc3545", "#fff"),
    "blocked": ("#fd7e14", "#212529"),
    "skipped": ("#adb5bd", "#212529"),
    "event": ("#6f42c1", "#fff"),
    "annotation": ("#20c997", "#052c65"),
    "log": ("#0dcaf0", "#052c65"),
}

BADGE_STYLE = (
    "display:inline-block;padding:1px 8px;border-radius:10px;font-size:11px;"
    "font-weight:600;line-height:16px;white-space:nowrap;background:{};color:{}"
)

#: JSON longer than this (characters) is cut wherever the admin shows it - detail pages, the
#: run timeline - with a note saying how much was left out; the raw value stays in the database.
#: Keeps a page small whatever a stage stored (a 5 MB annotation payload once made a 15 MB page).
MAX_JSON_CHARS = 2_000


def badge(label: str, tone: str | None = None) -> SafeString:
    """A coloured pill for ``label``; ``tone`` picks the colour (default: ``label`` itself)."""
    key = tone or label
    bg, fg = STATUS_COLOURS.get(key) or TONE_COLOURS.get(key) or ("#e9ecef", "#212529")
    return format_html(
        '<span class="dw-badge dw-{}" style="{}">{}</span>',
        str(key).lower(),
        format_html(BADGE_STYLE, bg, fg),
        label,
    )


def status_badge(status: str | None) -> SafeString | str:
    """The coloured badge of a run, stage or job status."""
    if not status:
        return "-"
    return badge(str(status))


def format_duration_ms(ms: int | float | None) -> str:
    """``850 ms``, ``12.3 s``, ``4m 05s``, ``2h 03m``, ``3d 04h``; ``-`` for ``None``."""
    if ms is None:
        return "-"
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    total = int(seconds)
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def duration_display(
    duration_ms: int | None, started_at: datetime | None, active: bool
) -> SafeString | str:
    """The stored duration, or the time elapsed so far for an active record that started."""
    if duration_ms is not None:
        return format_duration_ms(duration_ms)
    if active and started_at is not None:
        elapsed = (timezone.now() - started_at).total_seconds() * 1000
        return format_html('<span title="still running">{} …</span>', format_duration_ms(elapsed))
    return "-"


def compact_time(at: datetime | None) -> SafeString | str:
    """``2026-12-01`` over ``14:00:27.125`` (local time, ms; the ISO time as a tooltip), so a
    time column stays narrow; ``-`` for ``None``."""
    if at is None:
        return "-"
    local = timezone.localtime(at)
    return format_html(
        '<span class="dw-nowrap" title="{}">{}<br>{}</span>',
        at.isoformat(),
        local.strftime("%Y-%m-%d"),
        local.strftime("%H:%M:%S.%f")[:-3],
    )


def to_json(value: Any) -> str:
    """``value`` as indented JSON (Django's encoder, so datetimes and UUIDs render)."""
    return json.dumps(value, indent=2, ensure_ascii=False, cls=DjangoJSONEncoder, default=str)


def cut_text(text: str, limit: int = MAX_JSON_CHARS) -> str:
    """``text`` cut to ``limit`` characters plus a ``… (N more characters)`` line when longer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… ({len(text) - limit:,} more characters)"


def bounded_json(value: Any, limit: int = MAX_JSON_CHARS) -> str:
    """``value`` as indented JSON, cut by :func:`cut_text` to at most ``limit`` characters."""
    return cut_text(to_json(value), limit)


def pretty_json(value: Any) -> SafeString | str:
    """``value`` pretty-printed in a ``<pre>`` block, at most ``MAX_JSON_CHARS`` characters;
    ``-`` for ``None``."""
    if value is None:
        return "-"
    return format_html('<pre class="dw-json">{}</pre>', bounded_json(value))


def short_json(value: Any, limit: int = 80) -> str:
    """``value`` as one line of JSON cut to ``limit`` characters (for list columns)."""
    if value is None:
        return "-"
    text = json.dumps(value, ensure_ascii=False, cls=DjangoJSONEncoder, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _registry() -> Any:
    from ..definition.registry import registry

    return registry


def run_change_url(run_id: Any) -> str | None:
    try:
        return reverse("admin:django_workflows_workflowrun_change", args=[str(run_id)])
    except NoReverseMatch:
        return None


def short_id(value: Any) -> SafeString:
    """The first 8 characters of an id in monospace, the whole id as a tooltip."""
    text = str(value)
    return format_html(
        '<span class="dw-id" title="{}" style="font-family:monospace">{}</span>', text, text[:8]
    )


def run_link(run_id: Any) -> SafeString | str:
    """A link to the run's admin page, showing the short id (no query: runs are linked by id,
    DM-11).
    """
    if run_id is None:
        return "-"
    url = run_change_url(run_id)
    if url is None:
        return short_id(run_id)
    return format_html('<a href="{}">{}</a>', url, short_id(run_id))


class StatusFilter(admin.SimpleListFilter):
    """Filter by the statuses a table can hold (``statuses``), plus "active" (not terminal)."""

    title = "status"
    parameter_name = "status"
    statuses: tuple[Status, ...] = tuple(Status)
    terminal: frozenset[str] = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED})

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("active", "Active (not finished)"),
            *((str(s.value), str(s.label)) for s in self.statuses),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if value == "active":
            return queryset.exclude(status__in=self.terminal)
        if value:
            return queryset.filter(status=value)
        return None


class CappedPaginator(Paginator):
    """A paginator that never runs a full ``COUNT(*)``: it counts only as far as the requested
    page plus ``PAGES_AHEAD`` pages (``SELECT COUNT(*) FROM (SELECT ... LIMIT n)``), so a list
    of millions of rows costs about what a list of thousands does. ``capped`` says that more
    rows exist than were counted (the list then shows "N+" and its last page link moves on as
    the operator pages forward).

    Args:
        page_hint: the page the request asks for (1-based; the admin passes ``?p=``).
    """

    #: Pages counted beyond the requested one.
    PAGES_AHEAD = 20
    #: Rows counted at most, whatever the page (pages beyond it are not reachable).
    MAX_COUNT = 1_000_000

    def __init__(self, *args: Any, page_hint: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.page_hint = max(1, page_hint)

    @cached_property
    def count(self) -> int:
        qs = self.object_list
        if not isinstance(qs, QuerySet):
            return len(qs)
        cap = min(self.MAX_COUNT, (self.page_hint + self.PAGES_AHEAD) * int(self.per_page))
        n = qs.order_by()[: cap + 1].count()
        self.capped = n > cap
        return min(n, cap)

    capped = False


class CappedPaginationMixin:
    """Gives :class:`CappedPaginator` the requested page number (``?p=``)."""

    paginator = CappedPaginator

    def get_paginator(
        self,
        request: HttpRequest,
        queryset: Any,
        per_page: int,
        orphans: int = 0,
        allow_empty_first_page: bool = True,
    ) -> Paginator:
        raw = request.GET.get("p", "1")
        page = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 9 else 1
        return CappedPaginator(queryset, per_page, orphans, allow_empty_first_page, page_hint=page)


class WorkflowFilter(admin.SimpleListFilter):
    """The registered workflow ids (bounded by the _registry(), no ``SELECT DISTINCT`` over the
    table); any other id works as ``?workflow_id=...``."""

    title = "workflow"
    parameter_name = "workflow_id"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(wid, wid) for wid in sorted(wf.id for wf in _registry())[:100]]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        return queryset.filter(workflow_id=self.value()) if self.value() else None


def fixed_choices_filter(field: str, title: str, choices: tuple[str, ...]) -> type:
    """A list filter on ``field`` offering ``choices`` (a fixed, bounded list) instead of the
    ``SELECT DISTINCT`` over the whole table that a plain field filter runs."""

    class FixedChoicesFilter(admin.SimpleListFilter):
        parameter_name = field

        def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
            return [(c, c) for c in choices]

        def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
            return queryset.filter(**{field: self.value()}) if self.value() else None

    FixedChoicesFilter.title = title
    FixedChoicesFilter.__name__ = f"{field.title().replace('_', '')}Filter"
    return FixedChoicesFilter


class ReadOnlyAdmin(CappedPaginationMixin, admin.ModelAdmin):
    """An admin that shows rows and never adds, changes or deletes them.

    The kernel owns these tables; with no change permission Django renders the detail page in
    view-only mode.
    """

    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts scan the table

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
