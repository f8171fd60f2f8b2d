"""What the engine is compared with: stored golden, live HF or a saved reference (`sources.py`,
`store.py`, `data.py`), and the prompts (`prompts.py`)."""
