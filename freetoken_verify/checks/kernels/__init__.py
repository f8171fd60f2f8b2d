"""kernels: every Triton kernel against its reference at the TP-local shapes of TP 1/2/4/8
(`check.py`; the NVFP4 part in `nvfp4*.py`, the engine kernels in `engine*.py`, one judge in
`judge.py`)."""
