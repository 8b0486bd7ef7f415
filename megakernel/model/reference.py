"""fp32 references built one layer at a time, for checking bf16 backends at full model size.

At North dims the bf16 weights take 61 GB; an fp32 copy of the whole model does not fit beside them on one GPU.
These functions upcast one layer's weights and one layer's KV slice at a time, so an fp32 reference costs a few GB.

- `fp32_forward`: the whole model in fp32 (the end-to-end reference).
- `fp32_layers_on`: each layer in fp32 applied to *another backend's* input to that layer (per-layer teacher
  forcing). A random-weight model amplifies any rounding difference layer after layer (see
  benchmarks/random_model_conditioning.py), so only this comparison isolates one backend's own error per layer.

Neither modifies the cache: K/V of the batch's tokens go into the fp32 copy of each layer's slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel.kv.cache import KVCache
from megakernel.model import layers as L
from megakernel.model.batch import ForwardBatch, ForwardTrace
from megakernel.model.cohere2_moe import Cohere2MoeModel
from megakernel.model.weights import LayerWeights, _map


def upcast_layer(lw: LayerWeights, dtype: torch.dtype = torch.float32) -> LayerWeights:
    return _map(lw, lambda t: t.to(dtype))


@torch.inference_mode()
def fp32_logits(model: Cohere2MoeModel, h: torch.Tensor, rows_per_chunk: int = 1024,
                head: torch.Tensor | None = None) -> torch.Tensor:
    """Final norm and LM head in fp32 on hidden states `h` [n, H] (any dtype); `head`: a cached fp32 LM head."""
    head = model.w.lm_head.float() if head is None else head
    norm_w = model.w.final_norm.float()
    out = []
    for a in range(0, h.shape[0], rows_per_chunk):
        x = L.norm(h[a:a + rows_per_chunk].float(), norm_w, model.cfg)
        out.append(F.linear(x, head) * model.cfg.logit_scale)
    return torch.cat(out)


@torch.inference_mode()
def fp32_forward(model: Cohere2MoeModel, batch: ForwardBatch, cache: KVCache,
                 trace: ForwardTrace | None = None) -> torch.Tensor:
    """The model's forward with fp32 weights and activations (the cache's stored K/V are read as fp32)."""
    h = F.embedding(batch.input_ids, model.w.embed).float()
    hidden = trace.hidden if trace is not None else None
    if hidden is not None:
        hidden.append(h)
    ctx = model.prepare(batch, cache, torch.float32)
    for i, lw in enumerate(model.w.layers):
        g, kv = cache.layer(i)
        h = model.layer(i, h, ctx, (g, kv.float()), trace, upcast_layer(lw))
        if hidden is not None:
            hidden.append(h)
    rows = batch.logits_rows if batch.logits_rows is not None else batch.last_rows()
    return fp32_logits(model, h[rows])


@torch.inference_mode()
def fp32_layers_on(model: Cohere2MoeModel, batch: ForwardBatch, cache: KVCache, inputs: list[torch.Tensor],
                   trace: ForwardTrace | None = None) -> list[torch.Tensor]:
    """Layer i in fp32 on `inputs[i]` (another backend's residual stream entering layer i, [T, H]) for every i;
    returns the fp32 outputs. Attention of the batch's tokens sees the cache's earlier K/V and the K/V this
    reference computes from `inputs[i]` for the batch's own tokens (teacher forcing of the layer's input)."""
    ctx = model.prepare(batch, cache, torch.float32)
    outs = []
    for i, lw in enumerate(model.w.layers):
        g, kv = cache.layer(i)
        outs.append(model.layer(i, inputs[i].float(), ctx, (g, kv.float()), trace, upcast_layer(lw)))
    return outs


def router_gap(model: Cohere2MoeModel, layer: int, h: torch.Tensor) -> torch.Tensor:
    """fp32 router logits' gap between the k-th and (k+1)-th expert for rows `h` entering `layer` (how close a
    top-k choice is to a tie)."""
    lw = model.w.layers[layer]
    x = L.norm(h.float(), lw.norm_weight.float(), model.cfg)
    logits = F.linear(x, lw.moe.router.float())
    top = logits.topk(model.cfg.num_experts_per_tok + 1, dim=-1).values
    return top[:, -2] - top[:, -1]
