"""`python -m tandem.cli`: how a deployment starts its own worker and server processes."""

import sys

from tandem.cli import main

sys.exit(main())
