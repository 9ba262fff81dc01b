"""Keyset (cursor) pagination of the run list: newest first, no ``COUNT(*)``.

DRF's :class:`~rest_framework.pagination.CursorPagination` keys on one field and breaks ties
with an offset, which degrades on runs created in the same microsecond (bulk inserts, imports).
:class:`RunCursorPagination` keeps DRF's contract (``cursor`` and ``page_size`` query
parameters, ``{"next", "previous", "results"}``) but its cursor is the pair
``(created_at, id)`` of the last row: a page is ``WHERE created_at <= c AND (created_at < c OR
id < i) ORDER BY created_at DESC, id DESC LIMIT n + 1``, one backward scan of the
``(created_at, id)`` index (``wf_run_created_id_idx``, or ``wf_run_status_created_idx`` after a
status filter), however deep the page.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet
from django.utils.dateparse import parse_datetime
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

from ..conf import workflow_settings
from .errors import APIError


class RunCursorPagination(CursorPagination):
    """``(created_at, id)`` keyset pages, newest first (see the module docstring)."""

    ordering = ("-created_at", "-id")
    page_size_query_param = "page_size"
    cursor_query_description = "The pagination cursor value (from `next` or `previous`)."
    page_size_query_description = "Number of runs per page (default API_PAGE_SIZE)."

    def get_page_size(self, request: Request) -> int:
        self.page_size = int(workflow_settings.API_PAGE_SIZE)
        self.max_page_size = int(workflow_settings.API_MAX_PAGE_SIZE)
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        try:
            size = int(raw)
        except ValueError:
            size = 0
        if not 1 <= size <= self.max_page_size:
            detail = f"expected an integer from 1 to {self.max_page_size}"
            raise APIError(f"page_size: {detail}", code="invalid", errors={"page_size": [detail]})
        return size

    # --- cursors: base64 of {"r": reverse, "t": created_at ISO, "i": id} ---------------------

    def _decode(self, request: Request) -> tuple[bool, datetime, uuid.UUID] | None:
        raw = request.query_params.get(self.cursor_query_param)
        if raw is None:
            return None
        try:
            data = json.loads(base64.urlsafe_b64decode(raw.encode("ascii")).decode("utf-8"))
            when = parse_datetime(data["t"])
            if when is None or when.tzinfo is None:
                raise ValueError("bad time")
            return bool(data.get("r")), when, uuid.UUID(str(data["i"]))
        except (KeyError, TypeError, ValueError, UnicodeError, binascii.Error):
            detail = "not a cursor this API returned"
            raise APIError(
                f"cursor: {detail}", code="invalid", errors={"cursor": [detail]}
            ) from None

    def _encode(self, reverse: bool, row: Any) -> str:
        data = {"r": int(reverse), "t": row.created_at.isoformat(), "i": str(row.pk)}
        token = base64.urlsafe_b64encode(json.dumps(data, separators=(",", ":")).encode())
        return replace_query_param(self.base_url, self.cursor_query_param, token.decode("ascii"))

    def paginate_queryset(
        self, queryset: QuerySet[Any], request: Request, view: Any = None
    ) -> list[Any]:
        """One page of ``queryset`` (already filtered), in ``-created_at, -id`` order."""
        self.request = request
        size = self.get_page_size(request)
        self.base_url = request.build_absolute_uri()
        cursor = self._decode(request)
        self._next_url: str | None = None
        self._previous_url: str | None = None
        if cursor is None:
            rows = list(queryset.order_by("-created_at", "-id")[: size + 1])
            page, more = rows[:size], len(rows) > size
            if more and page:
                self._next_url = self._encode(False, page[-1])
            return page
        reverse, when, rid = cursor
        if not reverse:
            keyset = Q(created_at__lte=when) & (Q(created_at__lt=when) | Q(id__lt=rid))
            rows = list(queryset.filter(keyset).order_by("-created_at", "-id")[: size + 1])
            page, more = rows[:size], len(rows) > size
            if page:
                self._previous_url = self._encode(True, page[0])
                if more:
                    self._next_url = self._encode(False, page[-1])
            return page
        keyset = Q(created_at__gte=when) & (Q(created_at__gt=when) | Q(id__gt=rid))
        rows = list(queryset.filter(keyset).order_by("created_at", "id")[: size + 1])
        more = len(rows) > size
        page = list(reversed(rows[:size]))
        if page:
            self._next_url = self._encode(False, page[-1])
            if more:
                self._previous_url = self._encode(True, page[0])
        return page

    def get_next_link(self) -> str | None:
        return self._next_url

    def get_previous_link(self) -> str | None:
        return self._previous_url

    def get_paginated_response(self, data: Any) -> Response:
        return Response({"next": self._next_url, "previous": self._previous_url, "results": data})

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        params = super().get_schema_operation_parameters(view)
        for param in params:
            if param["name"] == self.page_size_query_param:
                param["schema"] = {"type": "integer", "minimum": 1, "maximum": 500}
        return params
