"""Leases on KV a prefill node (P) holds for a decode node (D), for any transport whose D pulls and P is passive.

P: a `LeaseTable` keeps each request's blocks under a transfer id until D's `done`, a release, or expiry with no
read in flight; `lease_ops(table)` are the control-channel ops `renew` and `done` that serve it.
D: `ask_renew`/`send_done` are their client halves over a Session; a `LeaseKeeper` renews the leases of requests
that queue here (short of blocks or behind others) once less than half is left, and ends the wait when P says no.
Seconds, never absolute times, cross the wire: hosts' clocks are not compared.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

from pdserve.sched_output import cdiv
from pdserve.transfer.channel.prompt_ids import handoff_fields
from pdserve.transfer.channel.proof import prompt_hash  # noqa: F401  (re-exported)

logger = logging.getLogger("pdserve.transfer")


def sends_first_token(config, req) -> bool:
    """P: `req`'s first token goes to D with its KV (the router asked, or the node's pd_first_token is "prefill"),
    so the lease covers all n prompt tokens; otherwise D replays the last one and n - 1 cross."""
    return req.hands_off_first_token or getattr(config, "pd_first_token", "replay") == "prefill"


def num_leased_tokens(config, req) -> int:
    """P: the prompt tokens whose KV a lease on `req` hands over (0: nothing, D prefills it itself)."""
    return req.num_prompt_tokens - (0 if sends_first_token(config, req) else 1)


def leased_params(config, port: int, tid: str, req, block_ids: list[int], block_size: int, **extra) -> dict:
    """The kv_transfer_params a producer answers for `req`'s lease `tid` (the engine adds the first token, when it
    goes too, and signs them): where D dials, what it reads, and for how long P holds it (seconds left, never an
    absolute time); with the prompt's ids when its server gave their input's digest (prompt_ids.py)."""
    n = req.num_prompt_tokens
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
            "remote_engine_id": config.engine_id, "remote_request_id": req.request_id,
            "remote_host": config.kv_advertise_host or config.kv_host, "remote_port": port,
            "remote_block_ids": list(block_ids[:cdiv(num_leased_tokens(config, req), block_size)]),
            "num_prompt_tokens": n, "prompt_hash": prompt_hash(req.prompt_token_ids),
            "lease_seconds": config.kv_lease_seconds, **handoff_fields(req), **extra}


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    expiry: float  # time.monotonic() on P
    pins: int = 0  # reads in flight: a pinned lease is never freed, whatever its expiry
    done: bool = False
    ended: float = 0.0  # time.monotonic() of `done` (D's done or a release)

    def over_since(self, now: float) -> Optional[float]:
        """When this lease stopped serving a reader (its end, or its expiry), if it has: its blocks are then held
        for no one, only until it is reaped (a read in flight still pins them)."""
        if self.done:
            return self.ended
        return self.expiry if now > self.expiry else None


class LeaseTable:
    """P's open leases by transfer id. Thread-safe: the engine opens and reaps, KV server threads pin and renew."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str, block_ids: list[int]) -> str:
        tid = uuid.uuid4().hex
        with self._lock:
            self.leases[tid] = Lease(request_id, list(block_ids), time.monotonic() + self.seconds)
        return tid

    def _live(self, tid: str) -> Optional[Lease]:
        lease = self.leases.get(tid)
        return None if lease is None or lease.done or time.monotonic() > lease.expiry else lease

    def pin(self, tid: str) -> Optional[Lease]:
        """The live lease `tid`, pinned and extended by a lease period (None: unknown, released or expired)."""
        with self._lock:
            if (lease := self._live(tid)) is not None:
                lease.pins += 1
                lease.expiry = time.monotonic() + self.seconds
            return lease

    def unpin(self, tid: str) -> None:
        with self._lock:
            self.leases[tid].pins -= 1

    def renew(self, tid: str) -> float:
        """Seconds left in the extended lease (D waits for blocks: extended, not pinned); 0 for none live."""
        with self._lock:
            if (lease := self._live(tid)) is None:
                return 0.0
            lease.expiry = time.monotonic() + self.seconds
            return self.seconds

    def confirm(self, tid: str) -> None:
        """D's `done`: the lease ends once no read holds it (a repeat, or an unknown id, is harmless)."""
        with self._lock:
            if (lease := self.leases.get(tid)) is not None and not lease.done:
                lease.done, lease.ended = True, time.monotonic()

    def release(self, tid: str, request_id: str) -> bool:
        """End the live lease `tid` of `request_id` now; False when there is none (so a repeat is harmless)."""
        with self._lock:
            lease = self._live(tid)
            if lease is None or lease.request_id != request_id:
                return False
            lease.done, lease.ended = True, time.monotonic()  # a read in flight keeps its pin; reap frees after it
            return True

    def reap(self) -> tuple[dict[str, float], int]:
        """({request id whose blocks may be freed now: when its lease ended or expired}, how many of them expired
        rather than ended)."""
        now, freed, expired = time.monotonic(), {}, 0
        with self._lock:
            for tid, lease in list(self.leases.items()):
                since = lease.over_since(now)
                if lease.pins == 0 and since is not None:
                    expired += not lease.done
                    del self.leases[tid]
                    freed[lease.request_id] = since
        return freed, expired

    def orphans(self) -> dict[str, float]:
        """{request id: since when} of leases over (ended or expired) whose blocks are not freed yet: held for no
        reader, until a read in flight unpins them and the next reap."""
        now = time.monotonic()
        with self._lock:
            return {lease.request_id: since for lease in self.leases.values()
                    if (since := lease.over_since(now)) is not None}

    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self.leases.values())

    def __len__(self) -> int:
        return len(self.leases)


# ---- the lease ops on the control channel (a Session: send(header), recv(into=[]) -> (header, views)) ----------
def lease_ops(table: LeaseTable, renew: Optional[Callable[[str], float]] = None) -> dict:
    """P's handlers of `renew` (answers the seconds now left, or `expired`) and `done`, for a ControlServer.
    `renew` replaces `table.renew` as the answer's source."""
    renew = renew or table.renew

    def on_renew(session, header: dict) -> None:
        left = renew(str(header.get("transfer_id", "")))
        session.send({"status": "ok", "lease_seconds": left} if left else {"status": "expired"})

    def on_done(session, header: dict) -> None:
        table.confirm(str(header.get("transfer_id", "")))
        session.send({"status": "ok"})

    return {"renew": on_renew, "done": on_done}


def ask_renew(session, tid: str) -> float:
    """D: extend lease `tid` on P; the seconds P now holds it, 0.0 when P has no such live lease."""
    session.send({"op": "renew", "transfer_id": tid})
    header, _ = session.recv(into=[])
    return float(header.get("lease_seconds", 0)) if header.get("status") == "ok" else 0.0


def send_done(session, tid: str) -> None:
    session.send({"op": "done", "transfer_id": tid})
    session.recv(into=[])


class LeaseKeeper:
    """D: how long P still holds the KV of each request queued here on it, kept alive while it queues.

    P states its lease as seconds left; it is counted here from the request's arrival, less a tenth for the hop
    from P. Past half of it a background `renew(params) -> seconds` (raising when P cannot be asked) extends it;
    a lease P no longer has, or a P that cannot be reached, ends the wait (the request then prefills locally)."""

    def __init__(self, default_seconds: float, renew: Callable[[dict], float], submit: Callable):
        self.default_seconds, self.renew, self.submit = default_seconds, renew, submit
        self._lock = threading.Lock()
        self._renewing: set[str] = set()  # requests whose renewal is in flight
        # until when (this host's clock) P holds each request's KV; keyed by the request itself, so an entry dies
        # with its request whatever path it ends by; written by renewals in the background, under _lock
        self._lease_end: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._watched: list = []  # heap of (when to look again, seq, request); engine thread only
        self._seq = 0

    def _seconds(self, req) -> float:
        return float((req.kv_transfer_params or {}).get("lease_seconds", self.default_seconds))

    def time_left(self, req) -> float:
        seconds, now = self._seconds(req), time.monotonic()
        with self._lock:
            left = self._lease_end.setdefault(req, req.arrival_time + 0.9 * seconds) - now
            due = 0 < left < seconds / 2 and req.request_id not in self._renewing
            if due:
                self._renewing.add(req.request_id)
        if due:
            self.submit(self._renew, req)
        return left

    def watch(self, req) -> None:
        """Look after `req` (params checked: a peer this side may dial) until its load is tried or it ends."""
        self._look_again(req, req.arrival_time)

    def _look_again(self, req, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._watched, (at, self._seq, req))

    def tick(self) -> None:
        """Engine thread, every step: watched requests past half their lease get a background renewal (the queue's
        head is also asked each step by the scheduler; this reaches the requests behind it). O(1) when none is due."""
        now = time.monotonic()
        while self._watched and self._watched[0][0] <= now:
            _, _, req = heapq.heappop(self._watched)
            if req.is_finished or req.kv_load_tried:
                continue
            if self.time_left(req) > 0:
                self._look_again(req, now + max(self._seconds(req) / 8, 0.01))

    def _renew(self, req) -> None:
        sent = time.monotonic()
        end = sent
        try:
            end = sent + 0.9 * self.renew(req.kv_transfer_params)
        except Exception as e:
            logger.info("request %s: could not renew the producer's lease: %s", req.request_id, e)
        finally:
            with self._lock:
                self._lease_end[req] = end
                self._renewing.discard(req.request_id)
