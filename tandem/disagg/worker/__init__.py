"""The worker process and what it shares with the router: the worker itself (cluster_worker.py), the
disaggregation connectors' worker halves (kv_connectors.py), the KV transports they drive, and the
typed, signed messages on the wire (messages, wire, secure)."""
