"""Pure serving policy shared by the single server and a cluster's router: admission and its
predictor (admission.py, deadlines.py) and the index of which prompt blocks are cached where
(prefix_index.py). Nothing here imports the server, the router or their processes."""
