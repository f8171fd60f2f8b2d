"""The bundled cases: their catalogue and generation (`catalogue.py`, `python -m
freetoken_verify.cases`), builders and layouts (`qwen3_5_moe.py`, `nvfp4.py`, and the quantized
cases' recipes in `quantized.py`), re-randomised weights and the tokenizer."""
