"""KV transport backends: shared memory (one host) and ZeroMQ over TCP (across hosts)."""
