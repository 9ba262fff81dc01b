"""Workflows and a plugin for the crash and race acceptance tests (loaded by the subprocesses
only, via ``EXTRA_INSTALLED_APPS=tests.acceptance.crashapp``).
"""
