"""bisect: the first module whose output diverges from TP=1 and from HF (`check.py`)."""
