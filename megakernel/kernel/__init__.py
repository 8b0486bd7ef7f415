"""The decode megakernel: one persistent CUDA kernel per decode step (sm_90), its host-side task-list builder,
a CPU simulator of the same task list, the on-demand nvcc build and the engine backend.

`opcodes.py` is the single source of truth for task opcodes, the task record layout, kernel parameters and
constants; the CUDA code receives them through a generated header (`opcodes.generate_header`).
"""
