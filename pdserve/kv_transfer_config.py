"""`--kv-transfer-config '{json}'`: the P/D connector's configuration, field names as vLLM's KVTransferConfig where
they exist, checked field by field (JSON types first, then values) so that a mistake is named at start-up."""
from __future__ import annotations

import dataclasses
import os
import ssl
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
# Connectors that move prompt KV between a prefill and a decode node. DecodeBenchConnector is the D-side arrival
# driver: it fills the KV of arriving requests with a local prefill pass, standing in for a producer.
PD_CONNECTORS = ("TcpConnector", "NixlConnector", "DecodeBenchConnector")
KNOWN_CONNECTORS = PD_CONNECTORS + ("MultiConnector",)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


INHERITED = ("kv_auth_token", "kv_tls_cert", "kv_tls_key", "kv_tls_ca", "pd_first_token")  # MultiConnector -> children
_STRINGS = ("kv_connector", "kv_role", "engine_id", "kv_host", "kv_advertise_host", "kv_auth_token", "kv_tls_cert",
            "kv_tls_key", "kv_tls_ca", "kv_load_failure_policy", "pd_first_token")


def _check_types(d: dict) -> None:
    """JSON types of the fields (nulls already dropped), named on failure: a wrong one would otherwise surface at
    start-up as an AttributeError, or not at all (kv_peers as one string became a tuple of characters: every
    load refused)."""
    for name in _STRINGS:
        if d.get(name) is not None and not isinstance(d[name], str):
            raise ValueError(f"kv_transfer_config.{name} must be a string, got {d[name]!r}")
    peers = d.get("kv_peers", [])
    if not isinstance(peers, (list, tuple)) or not all(isinstance(p, str) and _is_host_port(p) for p in peers):
        raise ValueError(f"kv_transfer_config.kv_peers must be a list of \"host:port\" strings, got {peers!r}")
    nice = d.get("kv_server_nice", 12)
    if isinstance(nice, bool) or not isinstance(nice, int):
        raise ValueError(f"kv_transfer_config.kv_server_nice must be an integer, got {nice!r}")
    if not isinstance(d.get("kv_connector_extra_config", {}), dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
    cap = d.get("kv_connector_extra_config", {}).get("max_connections", 1)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:  # P's KV server: a bad cap would refuse every D
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.max_connections must be an integer >= 1, "
                         f"got {cap!r}")
    direct = d.get("kv_connector_extra_config", {}).get("direct_handoff", True)
    if not isinstance(direct, bool):  # D (TcpConnector): an early request's engine awaits P's params on its KV channel
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.direct_handoff must be true or false, "
                         f"got {direct!r}")
    kids = d.get("connectors", [])
    if not isinstance(kids, (list, tuple)) or not all(isinstance(c, dict) for c in kids):
        raise ValueError("kv_transfer_config.connectors must be a list of connector objects")


def _is_host_port(s: str) -> bool:
    host, sep, port = s.rpartition(":")
    return bool(sep and host.strip("[]") and s == s.strip() and port.isdigit() and 0 < int(port) < 65536)


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config '{json}'`, field names as vLLM's KVTransferConfig where they exist."""
    kv_connector: str
    kv_role: KVRole
    engine_id: str = ""
    kv_host: str = "127.0.0.1"  # producer: bind address of the KV server
    kv_port: int = 14579
    kv_advertise_host: Optional[str] = None  # what P tells D to dial (default: kv_host)
    kv_peers: tuple = ()  # consumer: "host:port" KV endpoints it may dial (default: loopback only)
    kv_auth_token: Optional[str] = None  # default: $PDSERVE_KV_TOKEN; required off loopback
    kv_lease_seconds: float = 30.0
    kv_transfer_timeout: float = 10.0
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # D: the loads of the queue's head start before a step is scheduled, and the step waits up to this long (ms) for
    # them, so a short pull joins this step instead of the next (one step less between P's answer and D's first
    # token); the running requests' step waits that long at most, once per load. 0: never wait.
    kv_load_wait_ms: float = 2.0
    # P: "prefill" puts the first token P sampled (with its logprobs) in every request's params, so D starts from it
    # with a plain decode step instead of replaying the last prompt token; "replay" (vLLM's way) only when the
    # router asks for it (pdserve's router with --pd-first-token prefill asks per request)
    pd_first_token: Literal["replay", "prefill"] = "replay"
    # TLS (optional; the HMAC handshake and frame tags run inside it). P serves TLS with kv_tls_cert/kv_tls_key
    # (PEM). D uses TLS when it has kv_tls_ca, or kv_tls_cert (a self-signed pair shared by the deployment: D trusts
    # that cert), and then verifies P's chain and that the cert names the host D dials (kv_advertise_host). With
    # neither, D speaks plain TCP, and a TLS P refuses it (the load fails and D prefills locally).
    kv_tls_cert: Optional[str] = None
    kv_tls_key: Optional[str] = None
    kv_tls_ca: Optional[str] = None
    # Nice value of P's KV server threads: at 12 (CFS weight 70 against the engine's 1024) readers get ~6% of a core
    # that P's engine also wants, and all of an idle one. 0: equal shares (a back-to-back reader halves a busy P's
    # core). The price: while P computes without pause, its reads crawl.
    kv_server_nice: int = 12
    kv_connector_extra_config: dict = field(default_factory=dict)
    connectors: tuple = ()  # children of a MultiConnector

    def peer_hosts(self) -> tuple[str, ...]:
        """The hosts of kv_peers ("host:port", an IPv6 host in brackets)."""
        return tuple(p.rsplit(":", 1)[0].strip("[]") for p in self.kv_peers)

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferConfig":
        if not isinstance(d, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown field(s) {', '.join(unknown)}")
        # null is the default, as an omitted field (configs dumped with every field), where the default is not null
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if v is not None or defaults[k] is None}
        for required in ("kv_connector", "kv_role"):
            if required not in d:
                raise ValueError(f"kv_transfer_config: missing field {required!r}")
        _check_types(d)
        # A MultiConnector's children share the deployment's token and TLS unless they set their own: a token
        # given once (e.g. --kv-auth-token) must never leave a child handshaking with an empty key.
        shared = {k: d[k] for k in INHERITED if d.get(k) is not None}
        d["connectors"] = tuple(cls.from_dict({**shared, **c}) for c in d.get("connectors", ()))
        d["kv_peers"] = tuple(d.get("kv_peers", ()))
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.kv_connector not in KNOWN_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector {self.kv_connector!r} is unknown; "
                             f"known: {', '.join(KNOWN_CONNECTORS)}")
        if self.kv_role not in typing.get_args(KVRole):
            raise ValueError(f"kv_transfer_config.kv_role {self.kv_role!r} is invalid; "
                             f"choose from {', '.join(typing.get_args(KVRole))}")
        if self.kv_connector == "MultiConnector" and not self.connectors:
            raise ValueError("kv_transfer_config.connectors: a MultiConnector needs at least one child")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_transfer_config.kv_load_failure_policy must be 'recompute' or 'fail'")
        if self.pd_first_token not in ("replay", "prefill"):
            raise ValueError(f"kv_transfer_config.pd_first_token must be 'replay' or 'prefill', got "
                             f"{self.pd_first_token!r}")
        if bool(self.kv_tls_cert) != bool(self.kv_tls_key):
            have, need = ("kv_tls_cert", "kv_tls_key") if self.kv_tls_cert else ("kv_tls_key", "kv_tls_cert")
            raise ValueError(f"kv_transfer_config.{need} is required with {have}")
        # what P signs into every request's params: a wrong type here would make D refuse them all (proof.malformed)
        if not isinstance(self.engine_id, str):
            raise ValueError(f"kv_transfer_config.engine_id must be a string, got {self.engine_id!r}")
        v = self.kv_load_wait_ms
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1000:
            raise ValueError(f"kv_transfer_config.kv_load_wait_ms must be a number of milliseconds in [0, 1000], "
                             f"got {v!r}")
        for name in ("kv_lease_seconds", "kv_transfer_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"kv_transfer_config.{name} must be a positive number of seconds, got {v!r}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number (0..65535), got {self.kv_port!r}")
        if not 0 <= self.kv_server_nice <= 19:
            raise ValueError("kv_transfer_config.kv_server_nice must be in 0..19")
        for name in ("kv_tls_cert", "kv_tls_key", "kv_tls_ca"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"kv_transfer_config.{name}: no such file {path!r}")
        if self.kv_host not in LOOPBACK and not self.auth_token():
            raise ValueError(f"kv_transfer_config.kv_host {self.kv_host!r} is not loopback: refusing to serve KV "
                             "without kv_auth_token (or PDSERVE_KV_TOKEN)")

    def auth_token(self) -> str:
        return self.kv_auth_token or os.environ.get("PDSERVE_KV_TOKEN", "")

    def tls_server_context(self) -> Optional[ssl.SSLContext]:
        if not self.kv_tls_cert:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.kv_tls_cert, self.kv_tls_key)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"kv_transfer_config.kv_tls_cert/kv_tls_key: cannot load the pair: {e}") from None
        return ctx

    def tls_client_context(self) -> Optional[ssl.SSLContext]:
        ca, name = (self.kv_tls_ca, "kv_tls_ca") if self.kv_tls_ca else (self.kv_tls_cert, "kv_tls_cert")
        if not ca:
            return None
        try:
            return ssl.create_default_context(cafile=ca)  # verifies the chain and the host name
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"kv_transfer_config.{name}: cannot load {ca!r} as trusted certificates: {e}") from None

    @property
    def is_pd_consumer(self) -> bool:
        multi = self.kv_connector == "MultiConnector"
        names = [c.kv_connector for c in self.connectors] if multi else [self.kv_connector]
        return self.kv_role == "kv_consumer" and any(n in PD_CONNECTORS for n in names)
