"""What the HTTP and gRPC frontends share: the link to the broker and workers (link.py), turning a
KServe v2 request into the broker's descriptor (requests.py), tracing, header forwarding,
restricted groups, shared-memory callers and the server's protocol extensions. Both frontend
packages import from here; nothing here knows HTTP's or gRPC's framing."""
