"""What our Triton kernels share: bf16 rounding, a dot that also runs in Triton's CPU
interpreter, programmatic dependent launch, and tile-size helpers.

Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run these kernels) multiplies bf16 operands of
`tl.dot` as integers, so there the operands are widened to fp32 first. bf16 products are exact in fp32, so the
result equals the tensor-core result up to the order of the fp32 additions.

Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the kernel before it is
still running. Each of ours first lets its own successor launch (`pdl_release`), may load what no kernel of this
step writes (weights, K/V of earlier positions, the uploaded step inputs), and calls `pdl_wait` before it reads
anything an earlier kernel of the step wrote; the wait returns once the previous kernel has finished and its
writes are visible, and since that kernel waited for its own predecessor the same way, for every earlier one.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:        # an older Triton: no PDL
    gdc_launch_dependents = gdc_wait = None


def pdl_supported(device: torch.device) -> bool:
    return (not INTERPRET and gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_opts(pdl: bool, **opts) -> dict:
    """Launch options of one kernel: PDL when asked (never in the interpreter, which cannot run it)."""
    return {**opts, "launch_pdl": True} if pdl else opts


@triton.jit
def pdl_release(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


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
