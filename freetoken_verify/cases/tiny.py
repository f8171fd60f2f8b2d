"""What the bundled tiny cases of every family share, in one place for the catalogue and the
family modules that build them."""

VOCAB = 301
"""Odd, so every TP size above 1 pads the vocab-parallel rows and slices the logits back."""
