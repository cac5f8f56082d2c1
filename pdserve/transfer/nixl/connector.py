"""The `nixl` KV transport (vLLM's NixlConnector): D reads P's leased blocks with one-sided NIXL reads.

Leases, the failure policy, compatibility checks and peer authentication stay pdserve's: D and P speak over the same
authenticated control channel as tcp (tcp_channel.py: the KV token proves both sides and the compat fields are
compared before any op), and only there does P hand out its NIXL metadata. UCX itself authenticates nothing and
listens on every interface: with loopback KV endpoints it is kept on `lo` (UCX_NET_DEVICES, unless set).

Producer (P) lifecycle of a request (nixl_producer.py):
1. a request with `kv_transfer_params.do_remote_decode` prefills and samples its one token as usual;
2. `request_finished` keeps its blocks under a lease (leases.py) and returns the params D needs (engine, control
   endpoint, transfer id, remote_block_ids, prompt length and hash, `lease_seconds`, `kv_connector`), which the
   engine signs;
3. the control server answers, on authenticated sessions only: `nixl_meta` (P's agent metadata and block layout),
   `renew` (as tcp), and `claim`: it pins the lease for the claiming D agent and answers the blocks and a hold of
   kv_lease_seconds + kv_transfer_timeout. A one-sided read cannot be refused nor seen, so the claim is what tells P
   that one may be in flight;
4. P's UCX worker serves D's read in its progress thread (niced to kv_server_nice, as tcp's server threads); the
   read's notification (the transfer id, from the claiming agent, seen by `get_finished`) unpins and ends the
   lease, and so does a `done` naming that agent; a claim whose hold ran out is unpinned too, since D has given up
   on that read by then. A bare `done` or the router's `release_lease` ends an unclaimed lease at once;
5. a lease that is unpinned and ended, or past its expiry, is released: `get_finished` hands the request id to the
   scheduler, which frees the blocks.

Consumer (D) lifecycle of a request (nixl_consumer.py):
1. the tcp consumer's checks (peer in `kv_peers`, prompt length and hash) of params a NixlConnector made;
2. the scheduler allocates blocks and parks the request in WAITING_FOR_REMOTE_KV; queued short of blocks, its lease
   is renewed over the control channel, as tcp's;
3. `start_load_kv`: on a loader thread, over a pooled session to P: `claim`, then (once per P agent) `nixl_meta`
   and `add_peer` (P's descriptor list prepared once), then one prepared READ of the claimed blocks into the
   request's own, notifying the transfer id;
4. a poller thread follows each read: DONE within its deadline (kv_transfer_timeout from the load's start, and never
   past the claim's hold) reports the load done; ERR (P died: ~20 ms after a SIGKILL) reports it failed (and tells
   P `done`, should it live), and the scheduler's failure policy recomputes or fails the request; any failure
   before the post (handshake refused, lease expired, P unreachable) is a failed load too, and one before the claim
   sends P a bare `done` (its lease ends now, if P hears it); still in flight at the
   deadline (a hung P), the policy runs at once, but the blocks under the read move to a stand-in in the
   scheduler's deferred_free, freed only once the read ends: a posted read cannot be cancelled and would write
   them whenever P answers;
5. an agent a read failed on is removed once none of its reads is in flight; a P restarted on the same address
   answers its claim with a new agent, which is added. Requests D prefills itself send P a bare `done`, as tcp's.
"""
from __future__ import annotations

import bisect
import logging
import os
import threading
import uuid
from contextlib import suppress
from typing import Optional

from pdserve.kv_transfer_config import LOOPBACK
from pdserve.transfer.nixl import agent as nixl_agent
from pdserve.transfer.base import ConnectorContext, FinishedTransfers
from pdserve.transfer.channel.leases import LeaseTable
from pdserve.transfer.roles import RoleConnector
from pdserve.transfer.nixl.consumer import NAME, NixlConsumer
from pdserve.transfer.nixl.producer import NixlProducer
from pdserve.transfer.channel.blocks import TransferStats

logger = logging.getLogger("pdserve.transfer")
INSTALL = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
# vLLM's NixlPromMetrics: its histograms (fed per DONE read from NIXL's telemetry), buckets included, and counters.
HISTOGRAMS = {"xfer_time_seconds": _SECONDS[1:], "post_time_seconds": _SECONDS,
              "bytes_transferred": tuple(2 ** (10 + i) for i in range(1, 25, 2)),
              "num_descriptors": (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)}
TELEMETRY = {"xfer_time_seconds": "xfer_duration_s", "post_time_seconds": "post_duration_s",
             "bytes_transferred": "bytes", "num_descriptors": "descriptors"}
COUNTERS = ("num_failed_transfers", "num_failed_notifications", "num_kv_expired_reqs")


class NixlStats:
    """The `vllm:nixl_*` series: per-bucket counts and sums of the histograms, and the counters. Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.hist = {k: ([0] * (len(b) + 1), [0.0]) for k, b in HISTOGRAMS.items()}  # last count: over every bucket
        self.counters = dict.fromkeys(COUNTERS, 0)

    def observe(self, telemetry: dict) -> None:
        with self.lock:
            for key, buckets in HISTOGRAMS.items():
                v = telemetry[TELEMETRY[key]]
                counts, total = self.hist[key]
                counts[bisect.bisect_left(buckets, v)] += 1  # Prometheus buckets hold values <= their bound
                total[0] += v

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def snapshot(self) -> dict:
        with self.lock:
            hist = {k: {"buckets": list(zip(HISTOGRAMS[k], _cumsum(c))), "count": sum(c), "sum": s[0]}
                    for k, (c, s) in self.hist.items()}
            return {"histograms": hist, "counters": dict(self.counters)}


def _cumsum(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts[:-1]:
        acc += c
        out.append(acc)
    return out


def _ucx_env(config) -> None:
    """Before the first agent of the process starts UCX (which reads them then, once per process)."""
    os.environ.setdefault("UCX_TLS", nixl_agent.DEFAULT_UCX_TLS)
    hosts = [config.kv_host] if config.kv_role != "kv_consumer" else []
    if config.kv_role != "kv_producer":  # no kv_peers: D dials loopback only
        hosts += list(config.peer_hosts()) or ["127.0.0.1"]
    if "UCX_NET_DEVICES" in os.environ:
        return
    if all(h in LOOPBACK for h in hosts):
        os.environ["UCX_NET_DEVICES"] = "lo"
    else:
        logger.warning("NIXL: UCX listens on every interface; set UCX_NET_DEVICES to the KV network's (e.g. eth0)")


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")} if os.path.isdir("/proc/self/task") else set()


class NixlConnector(RoleConnector):
    def __init__(self, config, ctx: ConnectorContext):
        if not nixl_agent.available():
            raise RuntimeError(f"kv_transfer_config.kv_connector {NAME} needs nixl, which is not importable here: "
                               f"{INSTALL}")
        super().__init__(config, ctx)
        _ucx_env(config)
        self.block_size, token = ctx.block_size, config.auth_token().encode()
        self.stats, self.nstats, self.lease_table = TransferStats(), NixlStats(), LeaseTable(config.kv_lease_seconds)
        self.agent: Optional[nixl_agent.NixlAgent] = None
        self.producer = self.consumer = None
        if config.kv_role in ("kv_producer", "kv_both"):
            self.producer = NixlProducer(config, token, ctx.compat, self.block_size, self.lease_table,
                                         self.stats)
            self.port = self.producer.port
        if config.kv_role in ("kv_consumer", "kv_both"):
            self.consumer = NixlConsumer(config, token, ctx.compat, self.block_size, self.stats, self.nstats)
            self.pool = self.consumer.pool

    def register_kv_caches(self, kv_caches: list) -> None:
        super().register_kv_caches(kv_caches)
        # A fresh name per start: D tells a restarted P (same address) from the agent it had added.
        name = f"{self.config.engine_id or self.config.kv_role}-{uuid.uuid4().hex[:12]}"
        before = _threads()
        self.agent = nixl_agent.NixlAgent(name, kv_caches)
        if self.producer is not None:
            self.producer.agent = self.agent
            # UCX's progress thread serves D's reads (over tcp it copies every byte): P's KV server, niced as
            # tcp's server threads are, so a busy P's engine keeps its share of the core.
            for tid in _threads() - before:
                with suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, tid, self.config.kv_server_nice)
        if self.consumer is not None:
            self.consumer.attach(self.agent)

    def nixl_stats(self) -> dict:
        return self.nstats.snapshot()

    # ---- both ----------------------------------------------------------------------------------------------
    def get_finished(self) -> FinishedTransfers:
        out = FinishedTransfers()
        if self.consumer is not None:
            self.consumer.tcp.keeper.tick()
            self.consumer.take_finished(out)
        if self.producer is not None and self.agent is not None:
            self.producer.poll()
        out.released_at, expired = self.lease_table.reap()
        out.done_sending = set(out.released_at)
        self.stats.count("lease_expired", expired)
        if expired:
            self.nstats.count("num_kv_expired_reqs", expired)
        return out

    def shutdown(self) -> None:
        super().shutdown()
        if self.agent is not None:
            self.agent.close()
