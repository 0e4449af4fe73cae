"""Kernel sources compiled at run time (installed as ``tedebug.kernels`` package data): the CUDA sources (``*.cu``,
``*.cuh``) by CuPy's NVRTC, and the C source of the CPU helpers (``host_fp8.c``) by the system C compiler."""
