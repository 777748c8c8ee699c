"""C helpers for the CPU's hot paths, built on first use with the system's compiler and loaded through ``ctypes``
(:mod:`kvsieve.native.build`); each has a PyTorch path, taken wherever the helper is not built or does not apply (off
the CPU, ``KVSIEVE_NATIVE=0``).

- :mod:`kvsieve.native.dequantize`: a precision tier's KIVI dequantization into the attention view (bit for bit);
- :mod:`kvsieve.native.tiered_attention`: a decoding query's attention over packed tiers and full-precision entries
  read in place (float32 softmax over exactly the dequantized entries; SDPA's output within rounding);
- :mod:`kvsieve.native.quantize`: a tier's new groups quantized and packed (bit for bit);
- :mod:`kvsieve.native.segment_attention`: a decoding query's attention over a ragged layer (heads holding different
  numbers of entries) read in place, every head in one call (SDPA's output within float32 rounding);
- :mod:`kvsieve.native.decoding_rows`: a decoding query's output and float32 softmax rows in one pass (what a layer
  compacting at every decoding step reads).

All five are in ``tiers.c``. Besides them: :mod:`kvsieve.native.evict_lowest` (``evict.c``: every-step eviction in
place, bit for bit), :mod:`kvsieve.native.merge_lowest` (``merge.c``: EMS's every-step evict-then-merge in place, the
general step's decisions within float32 rounding), :mod:`kvsieve.native.column_sums` (``statistics.c``: a bf16
prompt's column sums from the flash kernel's log-sum-exp) and :mod:`kvsieve.native.fused_attention`
(``fused_attention.c``: a bf16 prompt's output, log-sum-exp and column sums from one set of exponentials on AMX
tiles, for ``fuse_statistics=True``; the output within bfloat16 rounding of SDPA's) and
:mod:`kvsieve.native.restkv_scores` (``reconstruction.c``: ReST-KV's indicator, temporal smoothing and top-``k`` drift
at a prompt's compaction in one pass; within float32 rounding).
"""
