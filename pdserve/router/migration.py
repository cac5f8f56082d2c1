"""Request migration (`--max-migrations`): an answer whose node fails goes on from another node.

1. A node that fails before sending anything (a reset on a kept-alive connection, a crash) is a retry: nothing
   reached the client. A P/D request goes to another D with the same params (a D that finds P's lease gone prefills
   the prompt itself); a whole (non-streamed) answer broken off is asked again of another node, without P/D.
2. A stream broken off after tokens went out (the node died, or its stream ended in a 5xx error event) is resumed:
   another node (a D, else a P: every node can decode) gets the client's request with the token ids the client
   has as `kv_transfer_params.resume_token_ids`. It prefills the prompt and those tokens itself and goes on as if
   it had sampled them (penalties, min_tokens, max_tokens and stop strings count them; a seeded stream skips their
   draws), so greedy and seeded output equal an unbroken run. Its stream starts with their text and ids again:
   the stream's `Splice` cuts them out (router/splice.py).
3. Up to `--max-migrations` resumes per request; past that, or with no node left, the stream ends with an error
   event and `[DONE]`, never a token twice.
What is migrated: one choice (n = 1), one prompt, no prompt logprobs (a resumed node would score the prompt again).
The router asks every node of such a stream for its token ids (`return_token_ids`) and strips them from what the
client gets unless it asked.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter

from pdserve.router.nodes import Fleet, Node
from pdserve.router.relay import DONE, error, reason
from pdserve.router.splice import Splice, sse_bytes
from pdserve.router.upstream import Answer, ConnectFailed, Reset, UpstreamError
from pdserve.serve.server_timing import KV_UNUSED_HEADER

logger = logging.getLogger("pdserve.router")
MAX_MIGRATIONS = 2  # --max-migrations' default


def asks_prompt_logprobs(body: dict) -> bool:
    """prompt_logprobs, or echo with completions' logprobs (an int) or chat's top_logprobs, as the nodes read them."""
    lp = body.get("logprobs")
    return body.get("prompt_logprobs") is not None or body.get("echo") is True and (
        isinstance(lp, int) and not isinstance(lp, bool) or body.get("top_logprobs") is not None)


def migrates(body: dict) -> bool:
    """Whether a request's answer can move to another node (the module's docstring says which)."""
    n, prompt = body.get("n"), body.get("prompt")
    batch = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))
    return n in (None, 1) and not batch and not asks_prompt_logprobs(body)


def resume_body(body: dict, token_ids: list[int], ask_ids: bool) -> dict:
    """The client's request as another node resumes it: no P/D params (it prefills what it needs itself)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if ask_ids:
        out["return_token_ids"] = True
    if token_ids:
        out["kv_transfer_params"] = {"resume_token_ids": list(token_ids)}
    return out


def is_reset(e: BaseException) -> bool:
    """An error that says the node sent nothing (a reset or a close on a kept-alive connection): safe to retry.
    A timeout is not: the node may still be working on it."""
    return isinstance(e, Reset)


class Attempt:
    """One node's answer being relayed; `end` releases it (its in-flight count, the connection) exactly once, from
    the relay or from the response's background task when the client left before the relay ran."""

    def __init__(self, node: Optional[Node] = None, upstream: Optional[Answer] = None):
        self.node, self.upstream = node, upstream
        self.pending: Optional[asyncio.Future] = None  # `node`'s answer still opening (router/early_decode.py)

    async def opened(self) -> Optional[str]:
        """The pending open's end: None when it answered 200 (now `upstream`), else why not (released)."""
        pending, self.pending = self.pending, None
        try:
            up = await pending
        except UpstreamError as e:
            self.node.in_flight -= 1
            if isinstance(e, ConnectFailed):
                self.node.healthy = False  # out of rotation until /health answers again
            return f"failed: {reason(e)}"
        except BaseException:  # the client left (or the router stops) while it opened: D sees its client go
            self.node.in_flight -= 1
            pending.cancel()  # a cancel reaches it already, a closed generator's exit would not
            pending.add_done_callback(_close_late)
            raise
        self.upstream = up
        if up.status_code != 200:
            text = (await up.aread())[:300].decode(errors="replace")
            await self.end()
            return f"answered {up.status_code}: {text}"
        return None

    async def end(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            await drop_open(pending, self.node)
        if self.upstream is not None:
            up, self.upstream = self.upstream, None
            self.node.in_flight -= 1
            await up.aclose()


async def drop_open(task: asyncio.Future, node: Node) -> None:
    """A node's answer still opening (`client.open`) that is no longer wanted: cancelled, or closed unread if it
    came anyway (the node sees its client go); the node's in-flight count given back."""
    task.cancel()
    late = (await asyncio.gather(task, return_exceptions=True))[0]
    node.in_flight -= 1
    if isinstance(late, Answer):
        await late.aclose()


_BACKGROUND: set[asyncio.Task] = set()  # held here: the loop keeps only weak references to tasks


def in_background(coro) -> None:
    """Runs `coro` without anyone waiting for it (a client's answer never waits for a connection to close)."""
    _BACKGROUND.add(t := asyncio.ensure_future(coro))
    t.add_done_callback(_BACKGROUND.discard)


def _close_late(task: asyncio.Future) -> None:
    """An answer that came although no longer wanted: closed unread."""
    if not task.cancelled() and task.exception() is None:
        in_background(task.result().aclose())


def next_node(fleet: Fleet, p_node: Optional[Node], tried: tuple, resumed: bool) -> Optional[Node]:
    """A D not tried yet (one P's proofs verify on, for P/D params); for a resumed request, else a P."""
    node = fleet.decode_for(p_node, tried)
    if node is None and resumed:
        node = fleet.fallback(tried)
    return node


class Migrator:
    """The router's migrations: its fleet and client, the limit, and `pdserve_router_migrations_total{kind}`
    (kind: stream, a stream resumed mid-way; whole, a whole answer asked again)."""

    def __init__(self, fleet: Fleet, registry: CollectorRegistry, max_migrations: int = MAX_MIGRATIONS):
        self.fleet, self.max_migrations = fleet, max_migrations
        self.count = Counter("pdserve_router_migrations", "Answers moved to another node after theirs failed",
                             ["kind"], registry=registry)
        # early decode (router/early_decode.py) by outcome: streamed (the D asked while P prefilled answered),
        # replaced (it failed before answering: a D was asked the usual way), dropped (not needed: P's answer was
        # all of it, P failed or was tried again, the client left)
        self.early = Counter("pdserve_router_early_decode", "Decode nodes asked while the prefill node prefilled "
                             "(--pd-early-decode), by outcome", ["outcome"], registry=registry)

    def tracks(self, body: dict) -> bool:
        """A stream that may be resumed elsewhere: the router follows its token ids."""
        return bool(self.max_migrations) and bool(body.get("stream")) and migrates(body)

    async def stream(self, path: str, body: dict, d_body: dict, headers: dict, p_node: Optional[Node],
                     splice: Splice, attempt: Attempt, on_first: Optional[Callable[[], None]] = None,
                     prefix: bytes = b"", release: Optional[Callable[[str], None]] = None):
        """The client's stream: `prefix` (P's first token), then `attempt`'s open stream (or, without one, `d_body`
        sent to a D), through `splice`; failures handled as the module's docstring says. `release(why)` ends P's
        lease when no D took `d_body`'s params (None: the caller settled the lease)."""
        async for out in _relay(self, path, body, d_body, headers, p_node, splice, attempt, on_first, prefix,
                                release):
            yield out

    async def whole_again(self, path: str, body: dict, headers: dict, tried: tuple, why: str) -> Response:
        """A whole answer a node broke off: nothing reached the client, so another node is asked (up to
        `max_migrations` of them), without P/D."""
        return await _whole_again(self, path, body, headers, tried, why)


async def _relay(m: Migrator, path: str, body: dict, d_body: dict, headers: dict, p_node: Optional[Node],
                 splice: Splice, attempt: Attempt, on_first: Optional[Callable[[], None]], prefix: bytes,
                 release: Optional[Callable[[str], None]]):
    fleet, client, max_migrations = m.fleet, m.fleet.client, m.max_migrations if m.tracks(body) else 0
    rid = headers["X-Request-Id"]
    if prefix:
        yield prefix
    send, tried, migrations = d_body, (attempt.node,) if attempt.upstream is not None else (), 0
    taken = release is None
    why = "no healthy decode node"
    try:
        if attempt.pending is not None:  # a D asked while P prefilled: its answer, else a D the usual way
            node = attempt.node
            failed = await attempt.opened()
            m.early.labels("streamed" if failed is None else "replaced").inc()
            if failed is None:
                taken = taken or not attempt.upstream.headers.get(KV_UNUSED_HEADER)
            else:
                attempt.node = None
                if not node.healthy:
                    tried += (node,)
                logger.warning("[%s] decode node %s, asked while P prefilled, %s; sending P's params to a decode "
                               "node", rid, node.url, failed)
        while True:
            if attempt.upstream is None:
                resumed = send is not d_body
                node = next_node(fleet, p_node if not resumed and d_body.get("kv_transfer_params") else None, tried,
                                 resumed)
                if node is None and not resumed and not splice.untracked and \
                        (node := fleet.fallback(tried, prefer=p_node)) is not None:
                    send, resumed = _resume(body, splice), True  # no D left: a P serves it whole from what the
                    # client has (P's lease is released at the end: no D took it)
                if node is None:
                    break
                tried += (node,)
                node.in_flight += 1
                try:
                    up = await client.open(node.url + path, json=send, headers=headers)
                except UpstreamError as e:
                    node.in_flight -= 1
                    why = f"decode node {node.url} failed: {reason(e)}"
                    if isinstance(e, ConnectFailed):
                        node.healthy = False  # out of rotation until /health answers again
                    elif not is_reset(e):
                        break
                    logger.warning("[%s] %s before answering; trying another node", rid, why)
                    continue
                attempt.node, attempt.upstream = node, up
                if up.status_code != 200:
                    text = (await up.aread())[:300].decode(errors="replace")
                    await attempt.end()
                    why = f"decode node {node.url} answered {up.status_code}: {text}"
                    if up.status_code < 500 and (resumed or not d_body.get("kv_transfer_params")):
                        break  # the client's own request, refused: any node would
                    if up.status_code < 500:  # P's params refused (e.g. its lease is gone): resume without them
                        send = _resume(body, splice)
                    continue
                if not resumed and not up.headers.get(KV_UNUSED_HEADER):
                    taken = True
            node = attempt.node
            try:
                async for raw in attempt.upstream.aiter_raw():
                    out = splice.feed(raw)
                    if out:
                        if on_first is not None:
                            on_first, first = None, on_first
                            first()
                        yield out
                    if splice.failed is not None:
                        break
                if splice.failed is None and splice.buf.strip():
                    out = splice.feed(b"\n\n")
                    if out:
                        yield out
                if splice.done:
                    return
                why = f"decode node {node.url} failed the request: {splice.failed}" if splice.failed else \
                    f"decode node {node.url} ended its stream without [DONE]"
            except UpstreamError as e:
                why = f"decode node {node.url} broke off its stream: {reason(e)}"
            finally:
                await attempt.end()
            if splice.done:  # broken off after its [DONE]: the stream is whole
                return
            if splice.finished:  # all tokens went out, only usage or [DONE] did not
                logger.warning("[%s] %s after the last token", rid, why)
                yield DONE
                return
            if not splice.sent_tokens and send is d_body and d_body.get("kv_transfer_params"):
                logger.warning("[%s] %s before a token of its own; trying another decode node", rid, why)
                continue  # the same params on another D
            if migrations >= max_migrations or splice.untracked:
                break
            migrations += 1
            m.count.labels("stream").inc()
            send = _resume(body, splice)
            logger.warning("[%s] %s after %d token(s): resumed on another node (migration %d of %d)", rid, why,
                           len(splice.token_ids), migrations, max_migrations)
        if max_migrations and splice.untracked:
            why += " (not resumed: the stream's token ids are not known)"
        logger.warning("[%s] %s: the stream ends with an error event", rid, why)
        # the client's stream stands at an event's end: the splice sends whole events only
        yield sse_bytes({"error": {"message": why, "type": "bad_gateway", "param": None, "code": 502}}) + DONE
    finally:
        if not taken:
            release("no decode node took the request's KV")


def _resume(body: dict, splice: Splice) -> dict:
    splice.resume()
    return resume_body(body, splice.token_ids, ask_ids=True)


async def _whole_again(m: Migrator, path: str, body: dict, headers: dict, tried: tuple, why: str) -> Response:
    rid, client = headers["X-Request-Id"], m.fleet.client
    for _ in range(m.max_migrations):
        node = next_node(m.fleet, None, tried, True)
        if node is None:
            break
        tried += (node,)
        node.in_flight += 1
        try:
            r = await client.request("POST", node.url + path, json=resume_body(body, [], ask_ids=False),
                                     headers=headers)
        except UpstreamError as e:
            why = f"decode node {node.url} failed: {reason(e)}"
            continue
        finally:
            node.in_flight -= 1
        if r.status_code >= 500:
            why = f"decode node {node.url} answered {r.status_code}"
            continue
        m.count.labels("whole").inc()
        logger.warning("[%s] %s: the answer came from %s instead (migration)", rid, why, node.url)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type", "application/json"),
                        headers={"X-Request-Id": rid})
    logger.warning("[%s] %s: answered 502", rid, why)
    return error(502, why, "bad_gateway")
