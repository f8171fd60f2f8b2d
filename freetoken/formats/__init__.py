"""Tensor formats, at the bottom of the engine: the shard-spec protocol and the generic specs
(`shard`, `specs`), and the NVFP4 format with its checkpoint parsing and shard specs
(`nvfp4/`). Nothing here imports another freetoken package."""
