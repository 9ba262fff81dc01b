"""The HTTP API of django-workflows (DRF): create, watch and operate runs over HTTP.

Mount it in a project's URLconf::

    path("api/workflows/", include("django_workflows.api.urls"))

Every write goes through ``Kernel.dispatch`` or the public helpers (``start_run``,
``cancel_run``, ``rerun_from``, ``annotate_run``, ``approval.approve/reject``); the API never
assigns a status field. Errors are JSON ``{"code", "message", "errors"?}`` with a stable
``code`` per error kind (see :mod:`django_workflows.api.errors`). The contract is published as
OpenAPI 3 at ``schema/`` and browsable at ``docs/``.
"""
