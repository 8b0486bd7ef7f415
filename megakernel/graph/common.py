"""What the graph backend's Triton kernels share: bf16 rounding, a dot that also runs in Triton's CPU
interpreter, and tile-size helpers.

Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run these kernels) multiplies bf16 operands of
`tl.dot` as integers, so there the operands are widened to fp32 first. bf16 products are exact in fp32, so the
result equals the tensor-core result up to the order of the fp32 additions.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def rbf(x):
    """Round fp32 to bf16 precision, as storing a PyTorch bf16 intermediate does."""
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


def pow2(n: int, at_least: int = 16) -> int:
    """Smallest power of two >= max(n, at_least): Triton block shapes are powers of two, and tl.dot wants >= 16."""
    return max(at_least, triton.next_power_of_2(max(1, n)))
