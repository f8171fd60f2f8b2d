"""collectives: every collective where the TP conventions put it, and the Communicator on inputs of
every layout (`check.py`, `sites.py`, `trace.py`, `probe.py`)."""
