"""The FP8 block format (HF `fp8`, compressed-tensors `block`): its definition, quantizer and
dequantizer (`block`), and how its block scales split across ranks, two ranks sharing a block
where a shard is smaller than or straddles one (`specs`)."""
