"""Frontends: KServe v2 over HTTP and gRPC, and msgpack over a unix socket; each reaches the daemon only
through the gateway (daemon/gateway.py)."""
