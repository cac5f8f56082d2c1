"""P's side of the tcp transport: leases on finished prefills, and the KV server that D reads them from.

Producer (P) lifecycle of a request:
1. a request with `kv_transfer_params.do_remote_decode` prefills and samples its one token as usual;
2. `request_finished` keeps its blocks under a lease (transfer id, expiry `kv_lease_seconds`) and returns the
   `kv_transfer_params` that tell D where and what to read (engine, endpoint, transfer id, prompt length and hash)
   and for how long (`lease_seconds` left, never an absolute time: hosts' clocks are not compared);
3. the KV server handshakes each of D's connections (within `kv_transfer_timeout`) and then serves its operations
   one after another until D closes the session or it sits idle (tcp_channel.py): authenticated reads of
   (transfer id, block index, count) from that lease only, pinning it while it reads and extending it (a read
   renews it, and so does a `renew`, which answers the seconds now left); an unknown, released or expired lease
   answers `expired`; a read not taken by D within `kv_lease_seconds` has its session shut;
4. D's `done` (a flag on its last read, or a bare `done` op), a `release_lease` (the router's
   `POST /v1/kv/release` on P, with the signed params, when no D took the request), or the lease running out with
   no read in flight, releases it: `get_finished` hands the request id to the scheduler, which frees the blocks.
With a handoff key (the router's early decode), the engine also posts the sealed params under it, and a D that took
the request early gets them and the KV in one `await` (channel/handoffs.py).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from pdserve.request import Request, RequestStatus
from pdserve.transfer.channel.leases import LeaseTable, lease_ops, leased_params, num_leased_tokens
from pdserve.transfer.channel.blocks import BLOCKS_PER_READ, KVBlocks, TransferStats
from pdserve.transfer.channel.control import MAX_CONNECTIONS, ControlServer, Deadline
from pdserve.transfer.channel.handoffs import SLICE, HandoffBoard, params_payload

logger = logging.getLogger("pdserve.transfer")


class TcpProducer:
    def __init__(self, config, token: bytes, compat: dict, block_size: int, leases: LeaseTable, blocks: KVBlocks,
                 stats: TransferStats, renew: Optional[Callable[[str], float]] = None):
        self.config, self.block_size, self.leases, self.blocks, self.stats = config, block_size, leases, blocks, stats
        extra = config.kv_connector_extra_config
        self.board = HandoffBoard()  # handoff key -> the sealed params, for a D that awaits them
        self.server = ControlServer(
            config.kv_host, config.kv_port, token, compat,
            {**lease_ops(leases, renew), "read": self._read, "await": self._await},
            tls=config.tls_server_context(), handshake_timeout=config.kv_transfer_timeout,
            wait_timeout=max(5.0, config.kv_lease_seconds),  # a wait between frames inside an operation
            idle_seconds=float(extra.get("session_idle_seconds", 60.0)), nice=config.kv_server_nice,
            count=stats.count, max_connections=int(extra.get("max_connections", MAX_CONNECTIONS)))
        self.port = self.server.port
        logger.info("KV server listening on %s:%d", config.kv_host, self.port)

    def _read(self, session, header: dict) -> None:
        tid = str(header.get("transfer_id", ""))
        self._send_blocks(session, tid, int(header["start"]), int(header["count"]), header.get("done") is True)

    def _send_blocks(self, session, tid: str, start: int, count: int, done: bool, params: Optional[dict] = None,
                     ) -> None:
        """A read's answer (one frame); with `params` an await's: the params frame, then the blocks in read
        answers of up to BLOCKS_PER_READ each."""
        lease = self.leases.pin(tid)
        if lease is None:
            session.send({"status": "expired"})
            return
        # The pin covers the send (on CPU the bytes go out straight from the cache), and a reader too slow to take
        # one frame within a lease period loses its session: the pin cannot outlive the lease it extended.
        deadline = Deadline(self.config.kv_lease_seconds, session.sock)
        try:
            ids = lease.block_ids[start:start + count]
            if params is None:
                session.send({"status": "ok", "count": len(ids)}, self.blocks.payload(ids))
            else:
                session.send({"status": "ok", "count": len(ids)}, params_payload(params))
                for i in range(0, len(ids), BLOCKS_PER_READ):
                    batch = ids[i:i + BLOCKS_PER_READ]
                    session.send({"status": "ok", "count": len(batch)}, self.blocks.payload(batch))
        finally:
            deadline.cancel()
            self.leases.unpin(tid)
            if deadline.hit:
                self.stats.count("slow_reader")
                logger.warning("KV read of transfer %s took over kv_lease_seconds: connection closed", tid)
        with self.stats.lock:
            self.stats.bytes_sent += len(ids) * self.blocks.bytes_per_block
        if done:  # D's last read: the lease ends once sent, as a `done` right after it would
            self.leases.confirm(tid)

    def _await(self, session, header: dict) -> None:
        """D's `await` of a handoff key (channel/handoffs.py): pending, none, expired, or the params and the KV."""
        key = str(header.get("key", ""))
        got = self.board.wait(key, min(max(float(header.get("wait", SLICE)), 0.0), SLICE))
        if got is None:
            session.send({"status": "pending"})
            return
        params, reason = got
        if params is None:
            session.send({"status": "none", "reason": reason})
            return
        self._send_blocks(session, str(params.get("transfer_id", "")), int(header["start"]), int(header["count"]),
                          True, params)

    def handoff(self, key: str, params: Optional[dict], reason: str) -> None:
        self.board.post(key, params, reason)

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        params = req.kv_transfer_params or {}
        if not params.get("do_remote_decode") or req.status not in (RequestStatus.FINISHED_STOPPED,
                                                                    RequestStatus.FINISHED_LENGTH):
            return False, None
        if num_leased_tokens(self.config, req) < 1:  # nothing to hand over: D prefills a one-token prompt itself
            return False, None
        tid = self.leases.open(req.request_id, block_ids)
        return True, leased_params(self.config, self.port, tid, req, block_ids, self.block_size)

    def shutdown(self) -> None:
        self.server.close()
