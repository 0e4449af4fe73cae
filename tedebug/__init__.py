"""tedebug: YAML-driven precision debugging for low-precision (FP8 / MXFP8 / NVFP4) training in PyTorch."""

__version__ = "0.1.0"
