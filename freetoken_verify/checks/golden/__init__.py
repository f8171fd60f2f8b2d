"""golden: prefill logits and greedy tokens against the reference, and graph replay against eager
decode (`check.py`, `graph_replay.py`)."""
