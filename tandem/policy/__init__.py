"""Pure serving policy shared by the single server, a cluster's router and the simulator: admission
and its predictor (admission.py, deadlines.py), the workers' measured speeds and the fleet as one
engine (latency.py), the per-request path choice (paths.py), and the index of which prompt blocks
are cached where (prefix_index.py). Nothing here imports the server, the router or their processes."""
