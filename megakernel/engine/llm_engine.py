"""The engine: requests in, tokens out, one `step()` at a time (continuous batching over a paged KV cache)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from megakernel.config import ModelConfig
from megakernel.engine.arg_checks import check_engine_args, check_model_len
from megakernel.engine.backends import choose_backend
from megakernel.engine.detokenizer import detokenize_step
from megakernel.engine.grammar import GrammarCompiler
from megakernel.engine.list_view import ListView
from megakernel.engine.loader import generation_eos_ids, load_model, load_tokenizer, resolve_device, resolve_dtype
from megakernel.engine.model_runner import ModelRunner
from megakernel.engine.outputs import CompletionOutput, RequestOutput
from megakernel.engine.sampler import SampledTokens, sample_async
from megakernel.engine.sampling_params import SamplingParams
from megakernel.engine.scheduler import ScheduledChunk, Scheduler
from megakernel.engine.sequence import PLACEHOLDER, Sequence
from megakernel.errors import ConfigError, MegakernelError, RequestError
from megakernel.kv.block_manager import BlockManager
from megakernel.kv.cache import KVCache, KVLayout, max_seq_len, plan_num_blocks
from megakernel.kv.prefix_cache import PrefixCache
from megakernel.model.cohere2_moe import (FAST_PREFILL_CHUNK, FAST_PREFILL_WITH_DECODES, Cohere2MoeModel,
                                          prefill_reserve_bytes)
from megakernel.model.decode_backend import DecodeBackend, TorchDecodeBackend
from megakernel.model.weights import ModelWeights

log = logging.getLogger("megakernel")


@dataclass
class EngineArgs:
    model: str | Path | None = None          # checkpoint folder; None = the embedded default model
    device: str | None = None                # "cuda", "cpu"; None = cuda if available
    dtype: str | torch.dtype | None = None   # None = bf16 on GPU, fp32 on CPU
    backend: str = "auto"                    # "auto" | "torch" | "megakernel" | "graph" (decode backend)
    max_num_seqs: int = 16
    max_model_len: int | None = None         # None = min(model's max positions, 32768)
    max_num_batched_tokens: int | None = None   # tokens per step; None = 8192 with the fast prefill, else 512
    fast_prefill: bool | None = None         # Triton/grouped-GEMM prefill; None = on for bf16 on CUDA
    prefill_with_decodes: int | None = None  # prefill tokens of a step that also decodes; None = 2048 with the
                                             # fast prefill (streams get a token every ~0.15 s), else no cap
    block_size: int = 64
    kv_cache_memory: int | None = None       # bytes for the KV pool (on a GPU, what a step needs beside it must
                                             # fit too); None = 1 GiB on CPU, 85% of free on GPU less that
    num_kv_blocks: list[int] | None = None   # exact blocks per KV group (overrides kv_cache_memory)
    enable_prefix_caching: bool = True
    seed: int = 0
    progress: bool = True
    async_scheduling: bool = True            # prepare step t+1 while the device runs step t
    gpu_memory_utilization: float | None = None   # GPU: KV budget leaves the rest of this fraction of the GPU
    fit_max_model_len_to_kv: bool = False    # lower max_model_len to what one sequence can hold in the KV pools


@dataclass
class _InFlight:
    """A launched step whose tokens the host has not read yet."""

    slots: list[tuple[Sequence, int]]        # (sequence, output index) of each sampled row
    result: SampledTokens | None
    checks: list[Callable[[], None]]         # decode-backend completion checks (raise MegakernelError)
    decoded: list[tuple[Sequence, int]]      # (sequence, position) the decode backend ran: failed if a check raises


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence] = field(default_factory=list)


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, *, config: ModelConfig | None = None,
                 weights: ModelWeights | None = None, tokenizer=None, **kwargs) -> None:
        args = args or EngineArgs(**kwargs)
        check_engine_args(args)
        self.args = args
        self.device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, self.device)
        if config is None:
            from megakernel.default_model import resolve_model_path

            path = resolve_model_path(args.model)
            config, weights = load_model(path, self.device, dtype, progress=args.progress)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
            self.model_path: Path | None = path
        else:
            if weights is None:
                raise ValueError("pass weights together with config")
            weights = weights.to(self.device, dtype)
            self.model_path = None
        check_model_len(args, config.max_position_embeddings)
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = generation_eos_ids(self.model_path, config, tokenizer)
        self.model = Cohere2MoeModel(config, weights, fast_prefill=args.fast_prefill)
        self.max_model_len = args.max_model_len or min(config.max_position_embeddings, 32768)
        self.chunk_tokens = args.max_num_batched_tokens or (FAST_PREFILL_CHUNK if self.model.fast_prefill else 512)

        backend, why = choose_backend(args.backend, self.device)
        log.info("decode backend %s (%s)", backend, why)
        if backend == "graph":
            from megakernel.graph.backend import fuse_router_into_qkv

            fuse_router_into_qkv(weights)      # its layout, before the KV pool takes the free memory
            torch.cuda.empty_cache()
        layout = KVLayout.for_model(config, args.block_size)
        if args.num_kv_blocks is not None:
            num_blocks = list(args.num_kv_blocks)
        else:
            beside = 0                         # what a step needs beside the pool on the GPU
            if self.device.type == "cuda":
                if backend == "graph":         # its static buffers and graph pools
                    from megakernel.graph.backend import reserved_bytes

                    beside += reserved_bytes(config, args.max_num_seqs)
                # the largest chunk's activations, so no accepted prompt runs out of memory
                beside += prefill_reserve_bytes(config, self.chunk_tokens, self.max_model_len, self.model.fast_prefill)
            if args.kv_cache_memory:           # the pool's size, as asked; what it needs beside must still fit
                budget = args.kv_cache_memory
                if self.device.type == "cuda":
                    free = torch.cuda.mem_get_info(self.device)[0]
                    if budget + beside > free:
                        raise ConfigError(
                            f"kv_cache_memory {budget / 2**30:.2f} GiB and the {beside / 2**30:.2f} GiB a "
                            f"{self.chunk_tokens}-token step needs beside it exceed the {free / 2**30:.2f} GiB free: "
                            f"lower --kv-cache-memory or --max-num-batched-tokens")
            else:
                budget = self._default_kv_budget() - beside
                if budget <= 0:
                    raise ConfigError(f"no GPU memory is left for the KV cache after the weights and a "
                                      f"{self.chunk_tokens}-token prefill chunk: lower --max-num-batched-tokens or "
                                      f"--max-model-len")
            num_blocks = plan_num_blocks(layout, budget, weights.dtype, args.max_num_seqs, self.max_model_len,
                                         self.chunk_tokens)
        if args.fit_max_model_len_to_kv:
            self._fit_max_model_len(layout, num_blocks)
        self.cache = KVCache(layout, num_blocks, self.device, weights.dtype)
        prefix_cache = PrefixCache(layout) if args.enable_prefix_caching else None
        self.blocks = BlockManager(layout, num_blocks, evictor=prefix_cache)
        cap = args.prefill_with_decodes or (FAST_PREFILL_WITH_DECODES if self.model.fast_prefill else None)
        self.scheduler = Scheduler(self.blocks, args.max_num_seqs, self.chunk_tokens, prefix_cache,
                                   prefill_with_decodes=min(cap, self.chunk_tokens) if cap else None)
        self.runner = ModelRunner(self.model, self.cache, self._make_decode_backend(backend))
        self.generator = torch.Generator(device=self.device).manual_seed(args.seed)
        self.grammar = GrammarCompiler(tokenizer, config.vocab_size)     # structured outputs (llguidance)
        self.requests: dict[str, _Request] = {}
        self._in_flight: _InFlight | None = None
        self._touched: dict[str, None] = {}      # requests that advanced since the last snapshot
        log.info("%s on %s (%s), decode backend %s, KV blocks %s of %d tokens",
                 self.model_path or "in-memory model", self.device, weights.dtype, self.runner.backend_name,
                 num_blocks, args.block_size)

    # ---- setup -------------------------------------------------------------------------------------------------
    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if self.args.gpu_memory_utilization is None:
                return int(free * 0.85)
            budget = int(free - total * (1 - self.args.gpu_memory_utilization))
            if budget <= 0:
                raise ConfigError(f"gpu_memory_utilization {self.args.gpu_memory_utilization} leaves no memory "
                                  f"for the KV cache ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)")
            return budget
        return 1 << 30

    def _fit_max_model_len(self, layout: KVLayout, num_blocks: list[int]) -> None:
        """Lower max_model_len to what one sequence can hold in the KV pools, so every admitted request fits (the
        server does this: a request the pools cannot hold is refused up front rather than cut short)."""
        cap = min(self.max_model_len, max_seq_len(layout, num_blocks, self.chunk_tokens))
        if cap < 2:
            raise ConfigError("the KV cache is too small to hold even one token per sequence")
        if cap < self.max_model_len:
            log.warning("the KV cache holds at most %d tokens per sequence; max_model_len lowered from %d to %d",
                        cap, self.max_model_len, cap)
            self.max_model_len = cap

    def _make_decode_backend(self, name: str) -> DecodeBackend:
        if name == "megakernel":
            from megakernel.kernel.backend import MegakernelBackend

            return MegakernelBackend(self.config, self.model.w, self.cache.layout, max_batch=self.args.max_num_seqs)
        if name == "graph":
            from megakernel.graph.backend import GraphBackend

            return GraphBackend(self.config, self.model.w, self.cache, max_batch=self.args.max_num_seqs,
                                max_model_len=self.max_model_len)
        return TorchDecodeBackend(self.model)

    # ---- requests ----------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    prompt: str | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is "
                               f"{self.max_model_len} (prompt plus at least one generated token)")
        layout, chunk = self.cache.layout, self.chunk_tokens
        for g, pool in enumerate(self.blocks.pools):
            n = layout.blocks_per_seq(g, len(prompt_token_ids) + 1, chunk)
            if n > pool.num_blocks:
                raise RequestError(f"the prompt needs {n} KV blocks in the {pool.name} pool, which has "
                                   f"{pool.num_blocks} in all: raise the KV cache memory")
        bad_bias = [t for t in params.logit_bias if not 0 <= t < self.config.vocab_size]
        if bad_bias:
            raise RequestError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary")
        grammar = self.grammar.check(params.structured_outputs) if params.structured_outputs else None
        req = _Request(prompt, list(prompt_token_ids))
        for i in range(params.n):
            seq = Sequence(request_id, i, req.prompt_token_ids, params, self.blocks.new_sequence(),
                           eos_token_ids=self.eos_token_ids)
            if grammar is not None:
                seq.matcher = self.grammar.matcher(params.structured_outputs, grammar)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def drain(self) -> list[RequestOutput]:
        """Read back the step still in flight, if any (nothing new is launched)."""
        touched = self._touched
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._resolve(step, touched)
        return self._outputs(touched)

    # ---- the loop ----------------------------------------------------------------------------------------------
    # Steps are pipelined one deep: step() schedules and launches step t+1, then reads back step t's tokens
    # while the device runs t+1. A sequence therefore enters step t+1 before the host knows its token from step
    # t: the token sits in its output as a placeholder and the device copies it into t+1's inputs. Stop checks
    # run one step late; a sequence that turns out to have stopped at t wasted one decode row at t+1, which is
    # discarded. With EngineArgs.async_scheduling=False each step is read back right after its launch.

    def step(self) -> list[RequestOutput]:
        """Launch one model step and return a snapshot of every request that advanced in the step before it
        (finished requests are dropped after their last snapshot)."""
        touched = self._touched           # kept across calls: a step that raised still reports what it ended
        chunks = self.scheduler.schedule()
        for seq in self.scheduler.ended:          # outgrew the whole KV pool alone: ended as "length"
            log.warning("request %s ended at %d tokens: the KV pool is full", seq.request_id, len(seq))
            touched[seq.request_id] = None
        self.scheduler.ended.clear()
        launched, refused = self._launch(chunks) if chunks else (None, None)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._resolve(previous, touched)
        if refused is not None:
            # The decode backend refused the step: fail the requests it was decoding (after the step before
            # was read back, so their earlier tokens count) and keep serving. Prefill chunks of the same step did
            # not advance and simply run again next step.
            error, decoding = refused
            self._fail([s for s in decoding if not s.finished], error, touched)
        if launched is not None and not self.args.async_scheduling:
            self._resolve(launched, touched)
            self._in_flight = None
        for seq in self.scheduler.running:
            self.scheduler.recycle(seq)
        return self._outputs(touched)

    def _launch(self, chunks: list[ScheduledChunk]
                ) -> tuple["_InFlight | None", tuple[MegakernelError, list[Sequence]] | None]:
        """Run the model and enqueue sampling for `chunks`; on a backend error return it (and the sequences the
        decode backend was given) instead."""
        decoding = [c for c in chunks if c.is_decode]     # before any state below changes what is_decode says
        try:
            sampled, logits, checks = self.runner.run(chunks)
        except MegakernelError as e:
            return None, (e, [c.seq for c in decoding] or [c.seq for c in chunks])
        for c in chunks:
            c.seq.num_computed = c.end
        seqs = [c.seq for c in sampled]
        result = sample_async(logits, seqs, self.generator) if seqs else None
        slots = []
        for row, seq in enumerate(seqs):
            idx = seq.append_output(PLACEHOLDER)
            seq.pending[idx] = (result.tokens, row)
            slots.append((seq, idx))
            if self._at_length_limit(seq, idx + 1):
                seq.awaiting_last = True
        decoded = [(c.seq, c.start) for c in decoding] if checks else []
        return _InFlight(slots, result, checks, decoded), None

    def _resolve(self, step: "_InFlight", touched: dict[str, None]) -> None:
        """Wait for a launched step, then commit its tokens (or fail what the decode backend was running)."""
        try:
            try:
                for check in step.checks:
                    check()
            except MegakernelError as e:
                failed = [(s, start) for s, start in step.decoded if not s.finished]
                for seq, start in failed:
                    # K/V from the failed launch (and any launched after it) must not reach the prefix cache
                    seq.num_computed = min(seq.num_computed, start)
                self._fail([s for s, _ in failed], e, touched)
                if getattr(e, "device_stuck", False):
                    # the kernel never ended: nothing queued behind it can be read back either
                    self._fail([s for s, _ in step.slots if not s.finished], e, touched)
                    return
            if step.result is None:
                return
            tokens, lps = step.result.resolve()
            for (seq, idx), tok, lp in zip(step.slots, tokens, lps):
                if seq.finished or seq.pending.get(idx, (None,))[0] is not step.result.tokens:
                    continue                          # ended meanwhile (stop seen late, abort, failure)
                del seq.pending[idx]
                self._commit(seq, idx, tok, lp)
                touched[seq.request_id] = None
        except BaseException as e:
            # Anything unexpected (a CUDA or tokenizer error): end this step's sequences so none is left waiting
            # for a token that will never be read back, then let the caller see the error.
            for seq, _ in step.slots:
                if not seq.finished:
                    seq.error = f"{type(e).__name__}: {e}"
                    self.scheduler.finish(seq, "abort")
                    touched[seq.request_id] = None
            raise

    def _fail(self, seqs: list[Sequence], e: Exception, touched: dict[str, None]) -> None:
        log.error("step failed: %s", e)
        for seq in seqs:
            seq.error = str(e)
            self.scheduler.finish(seq, "abort")
            touched[seq.request_id] = None

    def _outputs(self, touched: dict[str, None]) -> list[RequestOutput]:
        self._touched = {}
        outputs = []
        for rid in touched:
            req = self.requests.get(rid)
            if req is None:                       # aborted meanwhile
                continue
            out = self._snapshot(rid, req)
            outputs.append(out)
            if out.finished:
                del self.requests[rid]
        return outputs

    def _at_length_limit(self, seq: Sequence, n_out: int) -> bool:
        """Whether seq's output ends at n_out tokens whatever they are (max_tokens or max_model_len)."""
        p = seq.params
        return (p.max_tokens is not None and n_out >= p.max_tokens) or \
            len(seq.prompt_token_ids) + n_out >= self.max_model_len

    def _commit(self, seq: Sequence, idx: int, tok: int, lp) -> None:
        """Output token `idx` of seq is `tok`: record it, then check stop conditions and max lengths."""
        p = seq.params
        seq.set_output(idx, tok)
        if lp is not None:
            seq.logprobs.append(lp)
        n_out = idx + 1
        reason, stop_reason = None, None
        if tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif not p.ignore_eos and tok in self.eos_token_ids:
            reason, stop_reason = "stop", None
        tok_text = self.tokenizer is not None
        if tok_text and reason is None:
            prev = len(seq.text)
            seq.text = detokenize_step(self.tokenizer, seq.output_token_ids, n_out, seq.text, seq.detok,
                                       p.skip_special_tokens)
            if p.stop:
                hit = _find_stop(seq.text, p.stop, prev)
                if hit is not None:
                    at, s = hit
                    seq.text = seq.text[: at + (len(s) if p.include_stop_str_in_output else 0)]
                    reason, stop_reason = "stop", s
        elif tok_text:            # a stop token: the text is everything before it
            seq.text = self.tokenizer.decode(seq.output_token_ids[:n_out - 1],
                                             skip_special_tokens=p.skip_special_tokens)
        grammar_end = reason is None and seq.matcher is not None and self._grammar_ends(seq, tok)
        if grammar_end:
            reason = "abort" if seq.error else "stop"
        if reason is None and self._at_length_limit(seq, n_out):
            reason = "length"
        if reason is None and seq.kv_capped:
            log.warning("request %s ended at %d tokens: the KV pool is full", seq.request_id, len(seq))
            reason = "length"
        if (reason == "length" or grammar_end) and tok_text:
            # the final text in full (a last incomplete character shows as U+FFFD, as a full decode gives it)
            seq.text = self.tokenizer.decode(seq.output_token_ids[:n_out], skip_special_tokens=p.skip_special_tokens)
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)

    @staticmethod
    def _grammar_ends(seq: Sequence, tok: int) -> bool:
        """Feed tok to seq's grammar; whether the sequence ends here (the grammar is complete, or refused tok,
        which the mask rules out: then seq.error says why)."""
        if not seq.matcher.accept(tok):
            seq.error = f"the grammar refused token {tok}: {seq.matcher.error}"
            return True
        return seq.matcher.done

    def _snapshot(self, rid: str, req: _Request) -> RequestOutput:
        """Every sequence's output so far. While a sequence runs its tokens and logprobs are views (O(1) per step:
        what a view covers never changes); a finished one's are lists of their own, made once."""
        outs = []
        for s in req.seqs:
            n = s.num_resolved
            lps = s.logprobs if s.params.logprobs is not None else None
            if s.finished:
                ids, lps = s.output_token_ids[:n], list(lps) if lps is not None else None
            else:
                ids = ListView(s.token_ids, s.num_prompt, s.num_prompt + n)
                lps = ListView(lps, 0, len(lps)) if lps is not None else None
            outs.append(CompletionOutput(s.index, ids, s.text, s.finish_reason, lps, s.stop_reason))
        errors = [s.error for s in req.seqs if s.error]
        return RequestOutput(rid, req.prompt, req.prompt_token_ids, outs,
                             finished=all(s.finished for s in req.seqs), error=errors[0] if errors else None,
                             num_cached_tokens=max((s.num_cached_prompt for s in req.seqs), default=0))

    def num_kv_blocks_in_use(self) -> int:
        """Blocks held by sequences (blocks only the prefix cache holds are free to evict, so not counted)."""
        pc = self.scheduler.prefix_cache
        used = sum(p.num_blocks - p.num_free for p in self.blocks.pools)
        return used - (pc.num_evictable(self.blocks) if pc is not None else 0)

    def stats(self) -> dict[str, float]:
        pc = self.scheduler.prefix_cache
        total = sum(p.num_blocks for p in self.blocks.pools)
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_usage": self.num_kv_blocks_in_use() / max(1, total),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_rate": pc.hit_rate() if pc is not None else 0.0,
        }


def _find_stop(text: str, stops: list[str], prev_len: int) -> tuple[int, str] | None:
    best = None
    for s in stops:
        at = text.find(s, max(0, prev_len - len(s) + 1))
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    return best
