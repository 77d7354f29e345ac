"""Where a router's workers come from: the launcher interface, local and Ray launchers, the one owner
of the processes it started (owner.py) and their restarts."""
