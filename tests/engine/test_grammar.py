"""Structured outputs in the engine: the grammar mask in the sampler (the same tokens as without it when it allows
everything; only allowed tokens otherwise; untouched rows stay as they were), and constrained generation through
the engine, pipelined and not, on the embedded model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megakernel.engine.sampler import sample
from megakernel.engine.sampling_params import SamplingParams
from megakernel.engine.sequence import Sequence
from megakernel.kv.block_manager import SequenceBlocks

V = 300


class _Mask:
    """A matcher stand-in with a fixed set of allowed tokens."""

    def __init__(self, allowed: set[int] | None) -> None:
        bits = np.zeros(((V + 31) // 32) * 32, dtype=np.uint8)
        bits[sorted(allowed) if allowed is not None else slice(0, V)] = 1
        self.words = np.packbits(bits, bitorder="little").view(np.int32)

    def bitmask(self) -> np.ndarray:
        return self.words


def _seqs(masks, **kw) -> list[Sequence]:
    out = []
    for i, m in enumerate(masks):
        s = Sequence(f"r{i}", 0, [1, 2, 3], SamplingParams(**kw), SequenceBlocks())
        if kw.get("seed") is not None:
            s.generator = torch.Generator().manual_seed(kw["seed"] + i)
        s.matcher = m
        out.append(s)
    return out


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=1.0, seed=3),
                                dict(temperature=0.8, top_p=0.9, top_k=40, seed=5, logprobs=2),
                                dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, seed=1)])
def test_mask_allowing_everything_changes_nothing(kw):
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3
    plain, lp_plain = sample(logits.clone(), _seqs([None] * 6, **kw))
    masked, lp_masked = sample(logits.clone(), _seqs([_Mask(None)] * 6, **kw))
    assert masked == plain
    assert [(r.logprob, r.top) if r else None for r in lp_masked] == [(r.logprob, r.top) if r else None
                                                                       for r in lp_plain]


def test_mask_restricts_only_its_rows():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)) * 3
    allowed = {7, 99, 250}
    plain, _ = sample(logits.clone(), _seqs([None] * 4, temperature=0))
    for _ in range(20):
        toks, _ = sample(logits.clone(), _seqs([None, _Mask(allowed), None, _Mask({42})], temperature=1.0))
        assert toks[1] in allowed and toks[3] == 42
    greedy, _ = sample(logits.clone(), _seqs([None, _Mask(allowed), None, None], temperature=0))
    assert greedy[0] == plain[0] and greedy[2:] == plain[2:]                   # unconstrained rows unchanged
    assert greedy[1] == max(allowed, key=lambda t: logits[1, t].item())       # the best allowed token


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    from megakernel import LLM

    pytest.importorskip("llguidance")
    return LLM()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_json_schema(llm, async_scheduling):
    import jsonschema

    from megakernel.engine.grammar import StructuredOutputsParams

    llm.engine.args.async_scheduling = async_scheduling
    try:
        spec = StructuredOutputsParams(json=SCHEMA)
        prompts = ["def fibonacci(n):", "import json", "Hello", "class Stack:"]
        free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
        outs = llm.generate(prompts + prompts, [SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)]
                            * 4 + [SamplingParams(temperature=0, max_tokens=40)] * 4, use_tqdm=False)
    finally:
        llm.engine.args.async_scheduling = True
    for o in outs[:4]:
        assert o.finish_reason == "stop", o.text          # the grammar ended the sequence
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert [o.text for o in outs[4:]] == [o.text for o in free]   # unconstrained neighbours: unchanged output


def test_engine_refuses_bad_grammar(llm):
    from megakernel.engine.grammar import StructuredOutputsParams
    from megakernel.errors import RequestError

    with pytest.raises(RequestError):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: nope(")),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
