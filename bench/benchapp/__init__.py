"""The benchmark's Django app: its workflows, a delivery-recording plugin and the trivial
django-q2 tasks of the bare-chain peer. Loaded only by benchmark subprocesses, through the
example project's ``EXTRA_INSTALLED_APPS=bench.benchapp`` hook.
"""
