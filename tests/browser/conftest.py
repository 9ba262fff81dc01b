"""What every browser test shares: the Chromium binary and its flags, the skip when it (or
the ``playwright`` package) is missing, and ``page``, a Playwright tab of a headless Chromium
for the ``live_server`` (1440 x 900; 15 s default timeout).

Chromium: ``apt-get install -y chromium`` (``.ci/run`` installs it). A test that needs another
window size calls ``page.set_viewport_size(...)``.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

#: The Chromium binary (``None``: not installed; every browser test is skipped).
CHROMIUM: str | None = shutil.which("chromium") or shutil.which("chromium-browser")
#: ``playwright`` is importable.
PLAYWRIGHT = importlib.util.find_spec("playwright") is not None
#: Chromium's flags: headless, no sandbox (containers), nothing fetched from the network.
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(autouse=True)
def _needs_chromium() -> None:
    """Skip a browser test (before its other fixtures seed anything) without Chromium or
    the ``playwright`` package."""
    if not PLAYWRIGHT:
        pytest.skip("the playwright package is missing")
    if CHROMIUM is None:
        pytest.skip("no chromium binary (apt-get install -y chromium; .ci/run installs it)")


@pytest.fixture
def page(live_server: Any) -> Iterator[Any]:
    """A Playwright page (``playwright.sync_api.Page``) of a fresh headless Chromium, 1440 x
    900, default timeout 15 s; the browser is closed after the test."""
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(viewport={"width": 1440, "height": 900})
        tab = context.new_page()
        tab.set_default_timeout(15_000)
        yield tab
        context.close()
        browser.close()


#: The superuser each browser test's world creates (``create_superuser(ADMIN_USER, ...,
#: ADMIN_PASSWORD)``) and :func:`log_in` signs in as.
ADMIN_USER = "admin"
ADMIN_PASSWORD = "s3cret-pw"


@pytest.fixture
def log_in(page: Any, live_server: Any) -> Callable[[], None]:
    """A function that signs ``page`` in to the admin of ``live_server`` as :data:`ADMIN_USER`
    (which the test's world must have created) and waits for the admin index."""
    from django.urls import reverse

    def sign_in() -> None:
        base = live_server.url
        page.goto(base + reverse("admin:login"))
        page.fill("#id_username", ADMIN_USER)
        page.fill("#id_password", ADMIN_PASSWORD)
        page.click("input[type=submit]")
        page.wait_for_url(f"{base}/admin/")

    return sign_in
