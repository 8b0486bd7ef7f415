"""Triton kernels below the model layer (shared helpers, prefill attention over the paged cache). Importing this
package needs Triton; the model imports it only on CUDA."""
