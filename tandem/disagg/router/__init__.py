"""The router process: a cluster's engine client (disagg_engine.py), each request's flow through the
workers (dispatch, flight), its view of them (registry, metrics, view, store_view), live migration and
the planner at work (planner_loop). It speaks to workers only through worker/'s messages and wire."""
