"""C helpers for the CPU's hot paths, built on first use with the system's compiler and loaded through ``ctypes``
(:mod:`kvsieve.native.build`); each has a PyTorch path that computes the same numbers, taken wherever the helper is
not built or does not apply (off the CPU, ``KVSIEVE_NATIVE=0``).

- :mod:`kvsieve.native.dequantize`: a precision tier's KIVI dequantization into the attention view.
"""
