"""CUDA sources compiled by CuPy at run time (installed as ``tedebug.kernels`` package data)."""
