"""Prefill/decode disaggregation: a router, prefill workers and decode workers, and the KV transports
between them. See docs/architecture.md ("Disaggregation") for the request flow."""
