"""Engine behaviour on a tiny checkpoint: batching, preemption, prefix cache, sampling options, bad requests."""

from __future__ import annotations

import pytest
import torch

from megakernel import LLM, SamplingParams
from megakernel.engine.sampler import sample
from megakernel.engine.sequence import Sequence
from megakernel.errors import RequestError
from megakernel.kv.block_manager import SequenceBlocks
from megakernel.model.decode_backend import DecodeBackend, TorchDecodeBackend
from tiny_models import write_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint("north_like", tmp_path_factory.mktemp("north_like"))


def make_llm(folder, **kw) -> LLM:
    kw = {"block_size": 4, "max_num_batched_tokens": 16, "progress": False, **kw}
    return LLM(str(folder), device="cpu", dtype="float32", **kw)


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(l),), generator=g).tolist()
            for l in torch.randint(3, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def alone(folder):
    llm = make_llm(folder)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in prompts()]


def test_busy_batch_equals_alone(folder, alone):
    llm = make_llm(folder)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == alone


def test_preemption_is_transparent(folder, alone):
    # 2 + 2 seqs worth of blocks for 6 sequences: forces preemption by recompute.
    llm = make_llm(folder, num_kv_blocks=[28, 28], enable_prefix_caching=False)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.blocks.all_free()


def test_prefix_cache_hit_gives_same_output(folder):
    llm = make_llm(folder)
    base = prompts(1, seed=3)[0] * 3           # a long prompt
    first = llm.generate(base, GREEDY, use_tqdm=False)[0]
    again = llm.generate(base, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= len(base) - 4
    assert again.token_ids == first.token_ids
    fresh = make_llm(folder, enable_prefix_caching=False).generate(base, GREEDY, use_tqdm=False)[0]
    assert fresh.token_ids == first.token_ids
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0
    assert llm.engine.num_kv_blocks_in_use() == 0


def test_seed_reproducible_alone_and_in_batch(folder):
    llm = make_llm(folder)
    p = prompts(1, seed=5)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a = llm.generate(p, sp, use_tqdm=False)[0].token_ids
    noisy = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3
    b = llm.generate([p] + prompts(3, seed=6), [sp] + noisy, use_tqdm=False)[0].token_ids
    c = llm.generate(p, SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True),
                     use_tqdm=False)[0].token_ids
    assert a == b
    assert a != c


def test_n_completions_and_logprobs(folder):
    llm = make_llm(folder)
    out = llm.generate(prompts(1)[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=3,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids) == 8
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
            assert max(lp.top.values()) >= lp.logprob - 1e-6


def test_stop_token_ids_and_max_tokens(folder, alone):
    llm = make_llm(folder)
    p, expect = prompts()[0], alone[0]
    stop_tok = expect[5]
    first = expect.index(stop_tok)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0]
    assert out.token_ids == expect[:first + 1] and out.finish_reason == "stop"
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == expect[:3] and out.finish_reason == "length"


def test_stop_strings_with_a_tokenizer(folder, alone):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")      # joins words with spaces
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    llm = make_llm(folder)
    llm.engine.tokenizer = hf_tok
    p, expect = prompts()[0], alone[0]
    text = hf_tok.decode(expect)
    stop = f"w{expect[6]}"
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert text.startswith(out.text) and len(out.token_ids) <= 7


def test_bad_requests_are_refused_and_nothing_is_lost(folder):
    llm = make_llm(folder, max_model_len=64)
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate([[5] * 64], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="vocabulary"):
        llm.generate([[5, 100000]], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
    # The engine is intact afterwards.
    assert llm.engine.num_kv_blocks_in_use() == 0 and not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids) == 24


def test_generation_stops_at_max_model_len(folder):
    llm = make_llm(folder, max_model_len=20)
    out = llm.generate([[5] * 10], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def _seq(**kw) -> Sequence:
    return Sequence("r", 0, [1, 2, 3], SamplingParams(**kw), SequenceBlocks())


def test_sampler_filters_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    order = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], -1)
    for _ in range(50):
        t, _ = sample(logits, [_seq(temperature=1.0, top_k=2)])
        assert t[0] in order[:2]
        t, _ = sample(logits, [_seq(temperature=1.0, top_p=float(probs[order[0]]) * 0.99)])
        assert t[0] == order[0]
        t, _ = sample(logits, [_seq(temperature=1.0, min_p=0.5)])
        assert probs[t[0]] >= 0.5 * probs.max()
    t, _ = sample(logits, [_seq(temperature=0.0)])
    assert t[0] == order[0]
    t, _ = sample(logits, [_seq(temperature=1.0, logit_bias={order[-1]: 1000.0})])
    assert t[0] == order[-1]


def test_sampler_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    seq = _seq(temperature=1.0)
    for _ in range(3000):
        counts[sample(logits, [seq], gen)[0][0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_a_failed_decode_step_fails_its_requests_and_serving_goes_on(folder):
    from megakernel.errors import MegakernelError

    class HangingBackend(DecodeBackend):
        """Stands in for the megakernel backend whose watchdog fired."""

        def decode_async(self, batch, cache, trace=None):
            raise MegakernelError("decode step hung: counter 17 stuck at 3 of 4")

    llm = make_llm(folder)
    llm.engine.runner.decode_backend = HangingBackend()
    outs = llm.generate(prompts(3), GREEDY, use_tqdm=False)
    assert all(o.finish_reason == "abort" and "counter 17" in o.error for o in outs)
    assert all(len(o.token_ids) == 1 for o in outs)      # the prefill's token, then the decode step failed
    assert llm.engine.num_kv_blocks_in_use() == 0
    llm.engine.runner.decode_backend = TorchDecodeBackend(llm.engine.model)
    assert llm.generate(prompts(1), GREEDY, use_tqdm=False)[0].token_ids == \
        make_llm(folder).generate(prompts(1), GREEDY, use_tqdm=False)[0].token_ids


def test_kv_pool_limits(folder):
    llm = make_llm(folder, num_kv_blocks=[6, 6], enable_prefix_caching=False)
    with pytest.raises(RequestError, match="KV blocks"):
        llm.generate([[5] * 30], GREEDY, use_tqdm=False)       # 8 blocks of 4 needed, 6 exist
    out = llm.generate([[5] * 10], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0]
    # 6 blocks of 4 back positions 0..23; the token sampled at position 23 is the last one
    assert out.finish_reason == "length" and len(out.token_ids) == 24 + 1 - 10
    assert llm.engine.num_kv_blocks_in_use() == 0


def test_max_model_len_fitted_to_the_kv_pools_at_construction(folder):
    """fit_max_model_len_to_kv (what the server asks for) lowers max_model_len inside the engine's constructor to
    what one sequence can hold, before the runner and decode backend are built; without it nothing changes."""
    from megakernel.errors import ConfigError

    # block size 4: 6 full-attention blocks hold 24 tokens; the sliding pool (window 8, chunk 16) needs 7 blocks
    fitted = make_llm(folder, num_kv_blocks=[6, 7], fit_max_model_len_to_kv=True).engine
    assert fitted.max_model_len == 24
    with pytest.raises(RequestError, match="max_model_len is 24"):
        fitted.add_request("r", [5] * 24)
    assert make_llm(folder, num_kv_blocks=[6, 7]).engine.max_model_len == 4096
    assert make_llm(folder, num_kv_blocks=[6, 4], fit_max_model_len_to_kv=True).engine.max_model_len == 12
    with pytest.raises(ConfigError, match="too small"):
        make_llm(folder, num_kv_blocks=[6, 1], fit_max_model_len_to_kv=True)
