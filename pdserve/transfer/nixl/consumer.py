"""D's side of the `nixl` transport (nixl.py has both lifecycles): claims over the control channel, one-sided reads.

The tcp consumer (tcp_consumer.py) does everything that does not move KV: it checks params, keeps leases of queued
requests alive, renews and releases (`check_remote`, `release_remote`), and sends the bare `done`s. Here: a loader
thread claims the lease over a pooled session and posts one prepared READ; one poller thread follows every read to
its end. A posted read cannot be cancelled, so the blocks under it stay out of use until it ends in DONE or ERR,
even when the request has moved on (the failure policy ran at the deadline, or the request was aborted): the
scheduler holds them (reported `overdue`, then `ended`). P's agents, added on first sight, are nixl_peers.py's.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Optional

from pdserve.request import Request
from pdserve.transfer.base import ConnectorMeta, FinishedTransfers, LoadJob
from pdserve.transfer.nixl import notif
from pdserve.transfer.nixl.agent import NixlError, Transfer
from pdserve.transfer.nixl.peers import AgentPeers
from pdserve.transfer.channel.peer_workers import PeerWorkers, peer_of
from pdserve.transfer.channel.protocol import TIMEOUTS, LeaseGone, ProtocolError
from pdserve.transfer.channel.blocks import KVBlocks, TransferStats
from pdserve.transfer.tcp.consumer import SHUTDOWN_GRACE, TcpConsumer

logger = logging.getLogger("pdserve.transfer")
NAME = "NixlConnector"  # params P made carry it, so a MultiConnector's tcp child leaves them to this one
POLL_SECONDS = 0.0005  # between polls of the reads in flight: a spinning poll slows UCX's own progress


def made_here(params: Optional[dict]) -> bool:
    return (params or {}).get("kv_connector") == NAME


@dataclass(eq=False)
class _Read:
    job: LoadJob
    xfer: Transfer
    peer: str  # P's agent name
    endpoint: tuple  # P's control channel (host, port)
    queued: float
    deadline: float  # past it D never uses what the read wrote: P's hold on the blocks may be over
    overdue: bool = False
    reported_overdue: bool = False  # the scheduler holds its blocks until this read's end is reported


class NixlConsumer:
    def __init__(self, config, token: bytes, compat: dict, block_size: int, stats: TransferStats, nstats):
        self.config, self.stats, self.nstats, self.token = config, stats, nstats, token
        self.tcp = TcpConsumer(config, token, compat, block_size, KVBlocks(), stats)
        self.pool, self.agent, self.peers = self.tcp.pool, None, None
        self._cv = threading.Condition()
        self._reads: list[_Read] = []
        self._events: list[tuple] = []  # (kind, request id, why, read): for the engine thread
        self._loading = 0  # loads between their start and their post (or failure)
        self._loaders = PeerWorkers(4, "kv-nixl-load")  # a hung P holds only its own requests' workers
        self._closed = False

    def attach(self, agent) -> None:
        self.agent, self.peers = agent, AgentPeers(agent)
        threading.Thread(target=self._poll, name="kv-nixl-poll", daemon=True).start()

    # ---- what the tcp consumer answers, for params made by a NixlConnector -------------------------------------
    def peer_allowed(self, host: str, port: int) -> bool:
        return self.tcp.peer_allowed(host, port)

    def check_remote(self, params: dict) -> float:
        return self.tcp.check_remote(params) if made_here(params) else 0.0

    def release_remote(self, params: dict, request_id: str) -> bool:
        return made_here(params) and self.tcp.release_remote(params, request_id)

    def get_num_new_matched_tokens(self, req: Request, num_local_computed: int) -> int:
        if not made_here(req.kv_transfer_params):
            return 0
        return self.tcp.get_num_new_matched_tokens(req, num_local_computed)

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_local_computed: int) -> None:
        self.tcp.update_state_after_alloc(req, block_ids, num_local_computed)

    def build_connector_meta(self) -> ConnectorMeta:
        return self.tcp.build_connector_meta()

    def lease_time_left(self, req: Request) -> float:
        return self.tcp.lease_time_left(req)

    def watch_lease(self, req: Request) -> None:
        if made_here(req.kv_transfer_params):
            self.tcp.watch_lease(req)

    def request_abandoned(self, req: Request) -> None:
        if made_here(req.kv_transfer_params):
            self.tcp.request_abandoned(req)

    # ---- loads ---------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        bare = [j for j in meta.loads if not j.dst_blocks]
        if bare:  # a `done` that only releases P's lease: the tcp consumer's, over the same control channel
            self.tcp.start_load_kv(ConnectorMeta(bare))
        for job in meta.loads:
            if job.dst_blocks:
                with self._cv:
                    self._loading += 1
                self._loaders.submit(peer_of(job.params), self._load, job, time.monotonic())

    def _endpoint(self, params: dict) -> tuple[str, int]:
        host, port = str(params.get("remote_host")), int(params.get("remote_port", -1))
        if not self.peer_allowed(host, port):
            raise ValueError(f"KV peer {host}:{port} is not in kv_peers")
        return host, port

    def _load(self, job: LoadJob, queued: float) -> None:
        """Claim, then post; the read's end is the poller's. Nothing is posted on any failure here, so the
        request's blocks go with the failure policy."""
        tid, claim, endpoint = str(job.params.get("transfer_id")), None, None
        try:
            endpoint = self._endpoint(job.params)
            until = queued + self.config.kv_transfer_timeout
            claim = self.pool.call(*endpoint, until, lambda s: self._claim(s, endpoint, job, until))
            name, src, deadline, nonce = claim
            if time.monotonic() >= deadline:
                raise TimeoutError("the deadline passed before the read was posted")
            xfer = self.agent.read(name, src, job.dst_blocks, notif.make(self.token, tid, self.agent.name, nonce))
            with self._cv:
                self._reads.append(_Read(job, xfer, name, endpoint, queued, deadline))
                self._cv.notify()
        except LeaseGone as e:  # nothing claimed, nothing left on P: prefilled here, whatever the policy
            self.stats.count("lease_gone")
            logger.info("request %s: %s: prefilling it here", job.request_id, e)
            with self._cv:
                self._events.append(("gone", job.request_id, str(e), None))
        except Exception as e:
            cause = "timeout" if isinstance(e, TIMEOUTS) else type(e).__name__
            self.stats.count(cause)
            self.nstats.count("num_failed_transfers")
            logger.warning("request %s: NIXL load failed (%s): %s", job.request_id, cause, e)
            with self._cv:
                self._events.append(("failed", job.request_id, f"KV load failed ({cause}): {e}", None))
            if claim is not None:  # claimed, nothing posted: P may free the blocks now
                self.peers.release(claim[0], suspect=isinstance(e, NixlError))
                self._tell_done(endpoint, tid)
            elif endpoint is not None:  # never claimed (P unreachable, the claim refused): a bare `done` ends the
                with suppress(RuntimeError):  # plain lease now, if P hears it, rather than at expiry (shut down?)
                    self.tcp.release_remote(job.params, job.request_id)
        finally:
            with self._cv:
                self._loading -= 1

    def _claim(self, session, endpoint: tuple, job: LoadJob, until: float) -> tuple[str, list[int], float, str]:
        """P pins the lease for this agent and answers its own agent, the blocks and how long it holds them; P's
        agent is added on first sight (its metadata only ever travels over an authenticated session). Safe to redo:
        P counts one claim per agent."""
        tid, sent = job.params["transfer_id"], time.monotonic()
        session.send({"op": "claim", "transfer_id": tid, "agent": self.agent.name, "start": job.src_start,
                      "count": len(job.dst_blocks)})
        header, _ = session.recv(into=[])
        if header.get("status") == "expired":
            raise LeaseGone(f"the producer no longer holds the KV of transfer {tid}")
        if header.get("status") != "ok" or len(header.get("block_ids", ())) != len(job.dst_blocks) or \
                not isinstance(header.get("notif_nonce"), str):
            raise ProtocolError(f"producer answered {header.get('status')!r} to the claim of transfer {tid}")
        name = str(header["agent"])

        def fetch() -> tuple:
            session.send({"op": "nixl_meta"})
            answer, views = session.recv()
            if answer.get("status") != "ok" or not views:
                raise ProtocolError(f"producer answered {answer.get('status')!r} for its NIXL metadata")
            return bytes(views[0]), answer["layout"]

        self.peers.use(endpoint, name, fetch)
        # P's hold starts when the claim reaches it, after `sent`: this side gives up on the read first.
        return name, [int(b) for b in header["block_ids"]], min(until, sent + float(header["hold_seconds"])), \
            header["notif_nonce"]

    def _tell_done(self, endpoint: Optional[tuple], tid: str) -> None:
        """P frees a claimed lease on `done` from its claimant (D will use nothing a read of it wrote); when this
        fails P frees at the claim's hold instead (vLLM's failed notification)."""
        try:
            until = time.monotonic() + self.config.kv_transfer_timeout
            self.pool.call(*endpoint, until, lambda s: (s.send({"op": "done", "transfer_id": tid,
                                                                 "agent": self.agent.name}), s.recv(into=[])))
        except Exception as e:
            self.nstats.count("num_failed_notifications")
            logger.info("transfer %s: could not tell the producer it may free the blocks: %s", tid, e)

    def _poll(self) -> None:
        while True:
            with self._cv:
                while not self._reads and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                reads = list(self._reads)
            for r in reads:
                state = self.agent.poll(r.xfer)  # raises nothing: a broken read is ERR
                now = time.monotonic()  # after the poll: a DONE seen by then completed by then
                if state != "PROC":
                    self._end(r, state, now)
                elif now > r.deadline and not r.overdue:
                    r.overdue = True
                    self.nstats.count("num_failed_transfers")
                    self.stats.count("timeout")
                    logger.warning("request %s: NIXL read not done within its deadline: the failure policy runs, "
                                   "its blocks stay out of use until the read ends", r.job.request_id)
                    self._event("overdue", r, "KV load failed (timeout): NIXL read not done within its deadline")
            time.sleep(POLL_SECONDS)

    def _end(self, r: _Read, state: str, now: float) -> None:
        used = state == "DONE" and not r.overdue
        if used:
            try:
                self.nstats.observe(self.agent.telemetry(r.xfer))
            except NixlError as e:
                logger.debug("no NIXL telemetry: %s", e)
            with self.stats.lock:
                self.stats.bytes_received += r.xfer.nbytes
                self.stats.seconds_receiving += now - r.queued
        elif not r.overdue:
            self.nstats.count("num_failed_transfers")
            self.stats.count("nixl_read_error")
        self.agent.release(r.xfer)
        self.peers.release(r.peer, suspect=state == "ERR")
        if state == "ERR" and not r.overdue:  # P may be alive (then it frees now), or gone (then nothing is lost)
            with suppress(RuntimeError):  # shut down meanwhile
                self._loaders.submit(peer_of(r.job.params), self._tell_done, r.endpoint,
                                     str(r.job.params.get("transfer_id")))
        # the read leaves _reads as its event arrives, in one step: has_pending() never reads false in between
        # (the engine would stop polling with the event unread: an ended read's blocks held until the next request)
        with self._cv:
            self._reads.remove(r)
            self._events.append(("done" if used else "ended" if r.overdue else "failed", r.job.request_id,
                                 "KV load failed: NIXL read error", r))

    def _event(self, kind: str, r: _Read, why: str) -> None:
        with self._cv:
            self._events.append((kind, r.job.request_id, why, r))

    def take_finished(self, out: FinishedTransfers) -> None:
        """Engine thread: fill `out`. An overdue read's request goes on now (the failure policy) without its blocks:
        the scheduler holds them (`overdue`) until the read's end is reported (`ended`)."""
        self.tcp.take_finished(out)
        with self._cv:
            events, self._events = self._events, []
        for kind, rid, why, r in events:
            if kind == "done":
                out.done_recving.add(rid)
            elif kind == "failed":
                out.failed[rid] = why
            elif kind == "gone":
                out.gone.add(rid)
            elif kind == "overdue":
                out.overdue[rid] = why
                r.reported_overdue = True
            elif r.reported_overdue:  # "ended": the overdue read is over, its blocks may be reused
                out.ended.add(rid)

    def has_pending(self) -> bool:
        with self._cv:
            mine = bool(self._reads or self._events or self._loading)
        return mine or self.tcp.has_pending()

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._loaders.shutdown(grace=SHUTDOWN_GRACE)
        self.tcp.shutdown()
