"""Beyond one machine: cost models (measured here or from a GPU's specs), a discrete-event simulator
of a whole deployment that runs the engine's own scheduler, and the planner's search over deployments."""
