"""Without a GPU, the graph backend's Triton kernels run in Triton's CPU interpreter: it must be switched on before
the kernels are defined, that is before `megakernel.graph.*` is first imported.

Two interpreter defects of Triton 3.6 are mended here, for the tests only (compiled kernels are unaffected):
- a scalar held as a 1-element array becomes a Python int through int(array), which numpy >= 2.3 refuses, so a
  loop whose bound derives from program_id fails;
- fp32 -> bf16 casts truncate instead of rounding to nearest even (the GPU rounds), which biases every bf16
  intermediate; casts are done by torch instead.
"""

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.language as tl
        from triton.runtime import interpreter as _interp
    except ImportError:
        _interp = None
    if _interp is not None:
        _patch_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor

        def _to_bf16(data: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)

        _cast, _fp_to_fp = _interp.InterpreterBuilder.cast_impl, _interp.InterpreterBuilder.create_fp_to_fp

        def cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return _interp.TensorHandle(_to_bf16(src.data), dst_type.scalar)
            return _cast(self, src, dst_type)

        def create_fp_to_fp(self, src, dst_type, rounding_mode):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return _interp.TensorHandle(_to_bf16(src.data), dst_type.scalar)
            return _fp_to_fp(self, src, dst_type, rounding_mode)

        _interp.InterpreterBuilder.cast_impl = cast_impl
        _interp.InterpreterBuilder.create_fp_trunc = cast_impl
        _interp.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
