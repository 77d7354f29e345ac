"""`tandem bench`: a load generator and metrics for any OpenAI-compatible server."""
