"""Frontends: KServe v2 over HTTP and msgpack over a unix socket."""
