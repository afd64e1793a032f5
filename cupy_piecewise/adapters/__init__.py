"""Adapters: one module per array library, each only translating its arrays for the core.

- :mod:`.torch`: torch CUDA tensors, read in place by ``data_ptr()`` and strides;
- :mod:`.cupy`: CuPy arrays (float16, and bfloat16 through ml_dtypes);
- :mod:`.numpy`: NumPy arrays, the float64 reference;
- :mod:`.dlpack`: any other object with ``__dlpack__`` / ``__dlpack_device__``, moved
  zero-copy to CuPy (GPU) or NumPy (CPU) and back.

Each is imported on first use: importing cupy_piecewise needs neither CuPy nor torch.
"""
