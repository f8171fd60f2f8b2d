"""Per-module activations: the engine's, with their TP layouts (`engine.py`), and HF's, named as the
engine's (`hf.py`)."""
