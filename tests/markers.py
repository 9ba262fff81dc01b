"""Markers shared by test modules."""

from __future__ import annotations

import pytest
from django.conf import settings

ON_POSTGRES = "postgresql" in settings.DATABASES["default"]["ENGINE"]

#: Tests of row locks and real concurrency: they mean something on PostgreSQL only.
postgres_only = pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL (row locks)")
