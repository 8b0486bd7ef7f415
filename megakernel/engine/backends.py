"""Which decode backend an engine builds: the megakernel on sm_90, CUDA graphs on any other CUDA GPU, the PyTorch
path on the CPU; asking for one the device cannot run is an error naming it, never a silent fallback."""

from __future__ import annotations

import torch

from megakernel.errors import ConfigError

BACKENDS = ("auto", "torch", "megakernel", "graph")


def choose_backend(requested: str, device: torch.device) -> tuple[str, str]:
    """The decode backend to build, and why: `auto` takes the megakernel on sm_90, CUDA graphs on any other CUDA
    GPU, the PyTorch path on the CPU. Asking for a backend the device cannot run is an error, not a fallback."""
    if requested not in BACKENDS:
        raise ConfigError(f"unknown backend {requested!r}: choose one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch", "requested"
    if device.type != "cuda":
        if requested == "auto":
            return "torch", f"{device} is not a CUDA device"
        raise ConfigError(f"backend {requested!r} needs a CUDA GPU; this engine runs on {device}")
    from megakernel.graph import graph_available
    from megakernel.kernel.backend import megakernel_available

    mk_ok, mk_why = megakernel_available(device)
    if requested == "megakernel":
        if not mk_ok:
            raise ConfigError(f"backend 'megakernel' is unavailable here: {mk_why} (use --backend auto or graph)")
        return "megakernel", "requested"
    g_ok, g_why = graph_available(device)
    if requested == "graph":
        if not g_ok:
            raise ConfigError(f"backend 'graph' is unavailable here: {g_why} (use --backend auto or torch)")
        return "graph", "requested"
    if mk_ok:
        return "megakernel", "auto: an sm_90 GPU runs the decode megakernel"
    if g_ok:
        return "graph", f"auto: the megakernel is unavailable ({mk_why}); CUDA graphs instead"
    return "torch", f"auto: neither the megakernel ({mk_why}) nor CUDA graphs ({g_why}) are available"
