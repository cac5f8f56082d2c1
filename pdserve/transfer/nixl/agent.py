"""One NIXL agent over pdserve's paged KV cache: what the `nixl` transport (vLLM's NixlConnector) is built on.

Both sides register their KV tensors (a region per layer [2, num_blocks, block_size, kv_heads, head_dim]): block b of
layer l, K (k=0) or V (k=1), is descriptor (2l + k) * num_blocks + b of a prepared list. D prepares its own list and
each peer's once; a read is one `make_prepped_xfer` over index lists, its notification reaching P (named by D's agent)
only once the read completed. Metadata and layout travel over pdserve's authenticated channel (no NIXL listener).
The nixl 1.5.1 behaviour behind these choices is measured in benchmarks/results/nixl_probe.md.
"""
import importlib
import logging
import os
import threading
import types
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("pdserve.transfer")

# NIXL's UCX backend opens every endpoint with peer failure handling, which shared memory (sysv, posix, cma) lacks:
# `sm,self` cannot even start it. `tcp` works on and across hosts and takes a same-host pair over the network, not cma
# (needs ptrace rights containers often deny). Host memory only: for RDMA or GPU KV set UCX_TLS (e.g. rc,cuda_copy,tcp).
DEFAULT_UCX_TLS = "tcp,self"
LAYOUT_VERSION = 1
_create_lock = threading.Lock()


class NixlError(RuntimeError):
    """A NIXL call failed; the message says which and why."""


@contextmanager
def _nixl(what: str):
    try:
        yield
    except NixlError:
        raise
    except Exception as e:
        raise NixlError(f"{what}: {type(e).__name__}: {e}") from e


def available() -> bool:
    """nixl is importable (the `nixl` shim over nixl_cu12 / nixl_cu13; runs without a GPU)."""
    try:
        return bool(importlib.import_module("nixl._api"))
    except Exception:  # ImportError, or a wheel whose shared libraries do not load
        return False


def _new_agent(name: str, delay_us: int, **config):
    """nixl_agent with the progress thread's poll() timeout set: nixl 1.5.1's Python API sets 0, so the thread spins
    (a core for the agent's life); with a delay it sleeps on the UCX worker's fd, waking on traffic or every delay."""
    api = importlib.import_module("nixl._api")  # its import configures the "nixl" logger: INFO lines on stdout
    os.environ.get("NIXL_LOG_LEVEL") or logging.getLogger("nixl").setLevel(logging.WARNING)
    conf, real = api.nixl_agent_config(**config), getattr(api, "nixlBind", None)
    base = getattr(real, "nixlAgentConfig", None)
    if not (delay_us and config.get("enable_prog_thread") and hasattr(base, "pthrDelay")):
        return api.nixl_agent(name, conf)
    class Config(base):  # the agent's own `pthrDelay = 0` lands here and becomes the delay asked for
        pthrDelay = property(base.pthrDelay.__get__, lambda self, _v: base.pthrDelay.__set__(self, delay_us))
    proxy = types.ModuleType(real.__name__)
    proxy.__dict__.update(real.__dict__, nixlAgentConfig=Config)
    with _create_lock:  # the module global is swapped only while this agent is built
        api.nixlBind = proxy
        try:
            return api.nixl_agent(name, conf)
        finally:
            api.nixlBind = real


@dataclass(eq=False)
class Transfer:  # one posted read; `state` sticks once DONE or ERR
    peer: str
    notif: bytes
    nbytes: int
    handle: object
    state: str = "PROC"


class NixlAgent:
    """Owns one NIXL agent (UCX backend) with `kv_caches` registered as blocks; safe to call from any thread. Over UCX
    tcp, P's worker answers D's reads: keep P's progress thread, or call `notifs()` often, or D's reads stall."""

    def __init__(self, name: str, kv_caches: list[torch.Tensor], *, progress_thread: bool = True,
                 progress_delay_us: int = 10_000, num_threads: int = 0, telemetry: bool = True):
        c0 = kv_caches[0] if kv_caches else torch.empty(0)
        if c0.dim() < 2 or c0.shape[0] != 2 or any(c.shape != c0.shape or c.dtype != c0.dtype or c.device != c0.device
                                                   or not c.is_contiguous() for c in kv_caches):
            raise ValueError("kv_caches: one contiguous [2, num_blocks, ...] tensor per layer, all alike")
        os.environ.setdefault("UCX_TLS", DEFAULT_UCX_TLS)  # read when the UCX backend starts, below
        self.name, self.num_blocks, self.num_regions = name, c0.shape[1], 2 * len(kv_caches)
        self.chunk_bytes = c0[0, 0].numel() * c0.element_size()
        self.mem_type, self.device_id = ("DRAM" if c0.device.type == "cpu" else "VRAM"), max(c0.get_device(), 0)
        self._kv, self._bases = list(kv_caches), [c.data_ptr() for c in kv_caches]  # memory outlives registration
        self._lock, self._peers, self._xfers = threading.RLock(), {}, set()  # peers: name -> (dlist, num_blocks)
        self._agent = self._reg = self._local = None
        try:
            with _nixl(f"NIXL agent {name!r} did not start (nixl installed? UCX_TLS={os.environ.get('UCX_TLS')!r})"):
                self._agent = _new_agent(name, progress_delay_us, enable_prog_thread=progress_thread,
                                         backends=["UCX"], capture_telemetry=telemetry, num_threads=num_threads)
                if "UCX" not in self._agent.backends:
                    raise NixlError(f"NIXL agent {name!r}: the UCX backend plugin is missing")
                regions = [(b, 2 * self.num_blocks * self.chunk_bytes, self.device_id, "") for b in self._bases]
                self._reg = self._agent.register_memory(self._agent.get_reg_descs(regions, self.mem_type))
                self._local = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", self._descs(self._bases, self.num_blocks, self.device_id), self.mem_type)
        except NixlError:
            self.close()
            raise

    def _descs(self, bases: list[int], num_blocks: int, device_id: int) -> np.ndarray:
        """Nx3 (address, length, device), region (layer, K/V) major, block minor."""
        cb = np.uint64(self.chunk_bytes)
        addr = (np.asarray(bases, np.uint64)[:, None] + np.arange(2 * num_blocks, dtype=np.uint64)[None] * cb).ravel()
        return np.stack([addr, np.full_like(addr, cb), np.full_like(addr, device_id)], axis=1)

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (name, UCX worker address, memory keys), for the peer's `add_peer`."""
        with self._lock:
            return self._agent.get_agent_metadata()

    def layout(self) -> dict:
        """Where this agent's blocks are (JSON-safe), for the peer's `add_peer`."""
        return {"version": LAYOUT_VERSION, "agent": self.name, "mem_type": self.mem_type,
                "device_id": self.device_id, "num_blocks": self.num_blocks, "num_regions": self.num_regions,
                "chunk_bytes": self.chunk_bytes, "base_addrs": list(self._bases)}

    peers = property(lambda self: list(self._peers))  # names, as add_peer returned them

    def add_peer(self, metadata: bytes, layout: dict) -> str:
        """Load a peer's metadata, prepare its block list once and wire the connection up; returns its name."""
        for key, here in (("version", LAYOUT_VERSION), ("mem_type", self.mem_type),
                          ("num_regions", self.num_regions), ("chunk_bytes", self.chunk_bytes)):
            if layout.get(key) != here:
                raise NixlError(f"peer KV layout differs in {key}: {layout.get(key)!r}, here {here!r}")
        want, n = layout["agent"], int(layout["num_blocks"])
        if 2 * len(layout["base_addrs"]) != self.num_regions or n < 1:
            raise NixlError("peer layout: base_addrs, num_regions and num_blocks disagree")
        with self._lock:
            if want in self._peers or want == self.name:
                raise NixlError(f"peer {want!r} is already added (remove_peer first)")
            with _nixl("peer metadata refused by NIXL"):
                name = self._agent.add_remote_agent(metadata)  # bytes in nixl 1.5.1
            name = name.decode() if isinstance(name, bytes) else name
            try:
                with _nixl(f"peer {name!r}"):
                    if name != want:
                        raise NixlError(f"peer metadata names agent {name!r}, its layout {want!r}")
                    self._peers[name] = (self._agent.prep_xfer_dlist(
                        name, self._descs(layout["base_addrs"], n, layout["device_id"]), self.mem_type), n)
                    self._agent.make_connection(name)  # wire-up now, not inside the first read
            except NixlError:
                self.remove_peer(name) if name in self._peers else self._agent.remove_remote_agent(name)
                raise
            return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer (unknown: no-op): its reads' handles are freed (in flight: see `release`), UCX disconnects."""
        with self._lock:
            if (p := self._peers.pop(name, None)) is None:
                return
            for t in [t for t in self._xfers if t.peer == name]:
                self.release(t, force=True)
            with suppress(Exception):
                p[0].release()
            with suppress(Exception):  # a dead peer may fail its disconnect: nothing is left to undo
                self._agent.remove_remote_agent(name)

    def read(self, peer: str, remote_block_ids, local_block_ids, notif: bytes = b"") -> Transfer:
        """Post one READ of the peer's blocks into ours (every layer, K and V); `notif` reaches the peer once it is
        done. Raises NixlError when nothing was posted; a failure after posting shows as poll() == 'ERR'."""
        r, loc = np.asarray(remote_block_ids, np.int64), np.asarray(local_block_ids, np.int64)
        if r.ndim != 1 or r.shape != loc.shape or not len(r):
            raise ValueError("read: remote and local block ids must be non-empty lists of one length")
        with self._lock:
            if peer not in self._peers:
                raise NixlError(f"unknown NIXL peer {peer!r}")
            dlist, n = self._peers[peer]
            if r.min() < 0 or r.max() >= n or loc.min() < 0 or loc.max() >= self.num_blocks:
                raise ValueError(f"read: block id out of range (peer has {n}, here {self.num_blocks})")
            regions, h = np.arange(self.num_regions, dtype=np.int64)[:, None], None
            try:
                with _nixl(f"read from {peer!r} not posted"):
                    h = self._agent.make_prepped_xfer("READ", self._local, (regions * self.num_blocks + loc).ravel(),
                                                      dlist, (regions * n + r).ravel(), notif_msg=notif)
                    if (state := self._agent.transfer(h)) == "ERR":
                        raise NixlError(f"read from {peer!r} not posted: transfer() returned ERR")
            except NixlError:
                with suppress(Exception):
                    h is not None and self._agent.release_xfer_handle(h)
                raise
            t = Transfer(peer, bytes(notif), len(r) * self.num_regions * self.chunk_bytes, h, state)
            self._xfers.add(t)
            return t

    def poll(self, t: Transfer) -> str:
        """'DONE', 'PROC' or 'ERR' (NIXL raises nixlRemoteDisconnectError once the peer died: that is ERR)."""
        with self._lock:
            try:
                t.state = self._agent.check_xfer_state(t.handle) if t.state == "PROC" and t.handle else t.state
            except Exception as e:
                logger.warning("NIXL read from %s failed: %s: %s", t.peer, type(e).__name__, e)
                t.state = "ERR"
            return t.state

    def telemetry(self, t: Transfer) -> dict:
        """A DONE read's NIXL telemetry (telemetry=True), the inputs of vLLM's nixl_* histograms; before release."""
        with self._lock, _nixl("NIXL telemetry"):
            x = self._agent.get_xfer_telemetry(t.handle)
        return {"xfer_duration_s": x.xferDuration / 1e6, "post_duration_s": x.postDuration / 1e6,
                "bytes": x.totalBytes, "descriptors": x.descCount}

    def release(self, t: Transfer, force: bool = False) -> None:
        """Free a read's handle once DONE or ERR; PROC is refused unless `force` (teardown), as a read cannot be
        cancelled: released, or its peer removed, it still writes our blocks whenever the peer answers. It ends in DONE,
        or ERR once the peer's connection resets (it died); UCX never notices a hung peer (stopped, kernel alive)."""
        with self._lock:
            if t.handle is None:
                return
            if self.poll(t) == "PROC" and not force:
                raise NixlError(f"read from {t.peer!r} still in flight: it cannot be cancelled, keep polling it")
            try:
                self._agent.release_xfer_handle(t.handle)
            except Exception as e:  # the handle's __del__ retries, then nixl keeps it for the agent's teardown
                logger.warning("NIXL could not release a read's handle: %s: %s", type(e).__name__, e)
            t.handle, t.state = None, "ERR" if t.state == "PROC" else t.state
            self._xfers.discard(t)

    def notify(self, peer: str, msg: bytes) -> None:
        """A notification bound to no read (e.g. nothing to read: P may free the blocks now)."""
        with self._lock, _nixl(f"notification to {peer!r} failed"):
            self._agent.send_notif(peer, msg)

    def notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name; progresses the agent too."""
        with self._lock:
            return self._agent.get_new_notifs() if self._agent is not None else {}

    def close(self) -> None:
        """Free reads, peers, lists, registration, then the agent: with its UCX worker gone, nothing writes any more."""
        with self._lock:
            for name in list(self._peers):
                self.remove_peer(name)
            with suppress(Exception):
                self._local and self._local.release()
                self._reg is not None and self._agent.deregister_memory(self._reg)
            self._agent = self._local = self._reg = None
