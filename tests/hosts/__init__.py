"""Multi-host real-process tests: network namespaces, own PostgreSQL, a qcluster per host."""
