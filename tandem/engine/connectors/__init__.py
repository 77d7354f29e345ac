"""The engine's KV connectors: the interface (base.py), several as one (multi.py) and the tiered store
(store.py). Disaggregation's connectors live beside the transports they drive (disagg/worker/)."""
