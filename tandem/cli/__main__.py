"""`python -m tandem.cli`: how a deployment starts its own worker and server processes."""

from tandem.cli import run

run()
