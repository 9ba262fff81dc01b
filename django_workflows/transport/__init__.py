"""Job transports: how workers are woken after a commit (ports.JobTransport)."""
