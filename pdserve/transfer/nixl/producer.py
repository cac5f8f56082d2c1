"""P's side of the `nixl` transport (nixl.py has both lifecycles): leases, claims, and the control server.

D's reads are one-sided: P neither sees nor can refuse them. What P knows comes over the authenticated control
channel (a `claim` before D posts, a `done`) and from NIXL (the read's notification, sent once it completed), so a
leased block stays pinned from a claim until its claimant's notification or `done`, or until the claim's hold ends
(by then D has given up on the read and uses nothing it wrote). A notification frees nothing unless its MAC verifies
for the claim (nixl/notif.py): a peer that can reach P's NIXL listener cannot free blocks a read is in flight on.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from pdserve.request import Request, RequestStatus
from pdserve.transfer.channel.leases import LeaseTable, lease_ops, leased_params, num_leased_tokens
from pdserve.transfer.nixl import notif
from pdserve.transfer.nixl.consumer import NAME
from pdserve.transfer.channel.blocks import TransferStats
from pdserve.transfer.channel.control import MAX_CONNECTIONS, ControlServer, is_loopback

logger = logging.getLogger("pdserve.transfer")


class NixlProducer:
    """P: the control server (claims, metadata, lease ops) and the claims D's reads hold on leases."""

    def __init__(self, config, token: bytes, compat: dict, block_size: int, leases: LeaseTable,
                 stats: TransferStats):
        self.config, self.block_size, self.leases, self.stats, self.token = config, block_size, leases, stats, token
        self.hold = config.kv_lease_seconds + config.kv_transfer_timeout
        self.agent, self.meta_served, self._lock = None, 0, threading.Lock()
        # tid -> {D agent: (hold ends, blocks claimed, the claim's notification nonce)}
        self.claims: dict[str, dict[str, tuple[float, int, str]]] = {}
        ops = {**lease_ops(leases), "done": self._done, "claim": self._claim, "nixl_meta": self._meta}
        self.server = ControlServer(
            config.kv_host, config.kv_port, token, compat, ops, tls=config.tls_server_context(),
            handshake_timeout=config.kv_transfer_timeout, wait_timeout=max(5.0, config.kv_lease_seconds),
            idle_seconds=float(config.kv_connector_extra_config.get("session_idle_seconds", 60.0)),
            nice=config.kv_server_nice, count=stats.count,
            max_connections=int(config.kv_connector_extra_config.get("max_connections", MAX_CONNECTIONS)))
        self.port = self.server.port
        logger.info("NIXL KV control server listening on %s:%d", config.kv_host, self.port)
        if not is_loopback(config.kv_host):  # TLS (if set) covers the control channel, never what UCX moves
            logger.warning("NIXL reads of this node's KV blocks cross the network unencrypted (UCX does not encrypt; "
                           "kv_tls_* covers only the control channel): keep the KV network private to the deployment")

    def _meta(self, session, header: dict) -> None:
        with self._lock:
            self.meta_served += 1
        session.send({"status": "ok", "layout": self.agent.layout()}, self.agent.metadata())

    def _claim(self, session, header: dict) -> None:
        tid, who = str(header.get("transfer_id", "")), str(header.get("agent", ""))
        start, count = int(header.get("start", 0)), int(header.get("count", 0))
        with self._lock:
            held = self.claims.setdefault(tid, {})
            lease = self.leases.leases.get(tid) if who in held else self.leases.pin(tid)  # a redo: pinned already
            ok = lease is not None and bool(who) and count > 0 and 0 <= start and start + count <= len(lease.block_ids)
            if ok:  # a redo keeps its nonce: a read posted under the first answer still proves itself
                nonce = held[who][2] if who in held else notif.new_nonce()
                held[who] = (time.monotonic() + self.hold, count, nonce)
            elif lease is not None and who not in held:
                self.leases.unpin(tid)
            if not held:
                del self.claims[tid]
        if not ok:
            session.send({"status": "expired" if lease is None else "error", "error": "bad claim"})
            return
        session.send({"status": "ok", "agent": self.agent.name, "block_ids": lease.block_ids[start:start + count],
                      "hold_seconds": self.hold, "notif_nonce": nonce})

    def _done(self, session, header: dict) -> None:
        tid = str(header.get("transfer_id", ""))
        self.leases.confirm(tid)
        if header.get("agent"):  # its claimant: D uses nothing that agent's read wrote, or it never posted one
            self._unclaim(tid, str(header["agent"]))
        session.send({"status": "ok"})

    def _unclaim(self, tid: str, who: str, confirm: bool = False) -> Optional[int]:
        """Drop `who`'s claim on `tid` (ending the lease first if `confirm`); the blocks it claimed, None if none."""
        with self._lock:
            held = self.claims.get(tid, {})
            if who not in held:
                return None
            if confirm:
                self.leases.confirm(tid)
            _, count, _ = held.pop(who)
            if not held:
                del self.claims[tid]
            self.leases.unpin(tid)
            return count

    def poll(self) -> None:
        """Engine thread: notifications of finished reads, and claims whose hold ran out."""
        for who, msgs in self.agent.notifs().items():
            for msg in msgs:
                tid = notif.transfer_id(msg)
                with self._lock:
                    claim = self.claims.get(tid or "", {}).get(who)
                ok = claim is not None and notif.verifies(self.token, msg, who, claim[2])
                count = self._unclaim(tid, who, confirm=True) if ok else None
                if count is None:  # not the claimant's (forged, another agent's, or late): it proves nothing
                    self.stats.count("nixl_unexpected_notification")
                    continue
                with self.stats.lock:
                    self.stats.bytes_sent += count * self.agent.num_regions * self.agent.chunk_bytes
        now = time.monotonic()
        with self._lock:
            late = [(tid, who) for tid, held in self.claims.items() for who, (until, _, _) in held.items()
                    if now > until]
        for tid, who in late:
            self._unclaim(tid, who)

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        params, n = req.kv_transfer_params or {}, num_leased_tokens(self.config, req)
        if not params.get("do_remote_decode") or n < 1 or req.status not in (RequestStatus.FINISHED_STOPPED,
                                                                             RequestStatus.FINISHED_LENGTH):
            return False, None
        tid = self.leases.open(req.request_id, block_ids)
        return True, leased_params(self.config, self.port, tid, req, block_ids, self.block_size, kv_connector=NAME)

    def shutdown(self) -> None:
        self.server.close()
