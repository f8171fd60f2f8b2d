"""memory: peak host and device memory of a load against the bytes the config says a rank holds
(`check.py`, `expected.py`, `sampler.py`)."""
