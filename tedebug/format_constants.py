"""Numbers that define the low-precision formats, in a module that imports nothing from tedebug.

Both the quantizers (`tedebug.quantization`) and the kernel launchers and statistics references
(`tedebug.backends`) need them, and the backends sit below the quantizers (a quantizer calls a backend and wraps the
buffers it returns, never the other way round), so the constants live on this ground floor.
`tedebug.quantization.formats` and `tedebug.quantization.nvfp4` re-export them under the same names.
"""

from __future__ import annotations

E4M3 = "E4M3"
E5M2 = "E5M2"
FP8_FORMATS = (E4M3, E5M2)

#: largest finite magnitude of each FP8 format
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
#: largest magnitude of FP4 E2M1
E2M1_MAX = 6.0
#: NVFP4's global scale range: the largest E4M3 block scale times the largest E2M1 value (2688, exact in fp32)
NVFP4_GLOBAL_MAX = FP8_MAX[E4M3] * E2M1_MAX

#: TransformerEngine's fixed sign vector of NVFP4's random Hadamard transform (applied to the rows of the 16 x 16
#: Hadamard matrix)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
