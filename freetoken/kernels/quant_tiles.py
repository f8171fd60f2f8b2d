"""Decode tiles of the weight-only quantized GEMMs (`quant_gemm.tiles_for`), measured on an
H200 by `bench/quant_linear.py --sweep --write` (keys `quant_gemm.table_key`: format kind,
TP-local weight shape, token bucket; values `QuantTiles.key()`); a call it lacks gets
`quant_gemm.choose_tiles`."""

H200: dict[str, str] = {}
