"""Driving the engine's snapshot streams for a response: what of a choice is new since the last chunk (`Tracker`),
several requests' streams interleaved (`merge`), and the final outputs of a request whose client may leave
(`collect_finals`)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request

from megakernel.engine.outputs import CompletionOutput, RequestOutput
from megakernel.errors import RequestError
from megakernel.north_format import strip_specials
from megakernel.server.async_engine import EngineDeadError, RequestFailed
from megakernel.server.errors import engine_error


class Tracker:
    """What of one choice's cumulative output has been sent: text (with stop-string hold-back and special tokens
    stripped) and tokens. Each delta looks only at the text that is new since the last one: the output so far is
    never rescanned.

    Text is sent up to `holdback` characters short of the end (a stop string may still cut it there), never ending
    inside an incomplete UTF-8 character ("\\ufffd") or inside what may be the start of a special-token string
    (stripped whole once it is complete)."""

    def __init__(self, holdback: int, specials: list[str] | None) -> None:
        self.holdback = holdback
        self.specials = specials or []
        self._starts = {s[0] for s in self.specials}
        self._longest = max(map(len, self.specials), default=0)
        self.sent_text = 0          # characters sent (after stripping)
        self.read_text = 0          # characters of the output text consumed
        self.sent_tokens = 0

    def text_delta(self, o: CompletionOutput, final: bool) -> str:
        text = o.text
        upto = len(text) if final else len(text) - self.holdback
        if not final:
            while upto > self.read_text and text[upto - 1] == "\ufffd":   # an incomplete UTF-8 sequence
                upto -= 1
            if self.specials:
                upto = self._before_partial_special(text, upto)
        if upto <= self.read_text:
            return ""
        out = text[self.read_text:upto]
        self.read_text = upto
        if self.specials:
            out = strip_specials(out, self.specials)
        self.sent_text += len(out)
        return out

    def _before_partial_special(self, text: str, upto: int) -> int:
        """`upto`, or the start of a trailing piece of text[:upto] that a special-token string may complete."""
        for j in range(max(self.read_text, upto - self._longest + 1), upto):
            if text[j] in self._starts:
                piece = text[j:upto]
                if any(s.startswith(piece) and s != piece for s in self.specials):
                    return j
        return upto

    def token_delta(self, o: CompletionOutput, visible: int) -> tuple[list[int], list]:
        upto = visible
        ids = o.token_ids[self.sent_tokens:upto]
        lps = (o.logprobs or [])[self.sent_tokens:upto]
        self.sent_tokens = max(self.sent_tokens, upto)
        return ids, lps


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' snapshot streams; closing the merge aborts every request."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect_finals(raw: Request, gens) -> dict[int, RequestOutput] | None:
    """The final output of each generator (by index), or None if the client disconnected first (which aborts
    the requests). Engine failures become OpenAI-shaped HTTP errors."""

    async def collect() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(gens):
            if out.finished:
                finals[i] = out
        return finals

    try:
        return await until_disconnect(raw, collect())
    except (RequestError, EngineDeadError, RequestFailed) as e:
        raise engine_error(e) from None


async def until_disconnect(raw: Request, coro):
    """Run coro; if the client disconnects first, cancel it (which aborts its requests) and return None."""
    task = asyncio.ensure_future(coro)

    async def listen() -> None:
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                return

    listener = asyncio.ensure_future(listen())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        listener.cancel()
        raise
    if task in done:
        listener.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled on purpose
        pass
    return None
