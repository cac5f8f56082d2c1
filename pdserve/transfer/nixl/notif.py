"""The read-done notification D's NIXL read carries to P, authenticated (issue 37 item 5).

P frees a claimed lease when the claimant's notification arrives, so a notification must prove it comes from the
claimant: anyone who can reach P's NIXL listener can send one under any agent name, and the transfer id travels in
the clear without TLS. P's claim answer (over the authenticated control channel) carries a fresh nonce; the
notification is `<transfer id>.<mac>`, the MAC an HMAC with the shared KV token (never sent) over a label of its
own, the transfer id, the claiming agent and that nonce. What must stay true: P acts on no notification whose MAC
does not verify for a claim it holds, and one claim's notification never verifies for another claim (the nonce)."""
from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Optional

LABEL = b"pdserve nixl read-done v1"


def new_nonce() -> str:
    return secrets.token_hex(16)


def _mac(token: bytes, tid: str, agent: str, nonce: str) -> str:
    msg = b"\0".join((LABEL, tid.encode(), agent.encode(), nonce.encode()))
    return hmac.new(token, msg, hashlib.sha256).hexdigest()[:32]


def make(token: bytes, tid: str, agent: str, nonce: str) -> bytes:
    """D's notification for its read of `tid` under the claim P answered `nonce` to (`agent`: D's own agent)."""
    return f"{tid}.{_mac(token, tid, agent, nonce)}".encode()


def transfer_id(msg: bytes) -> Optional[str]:
    """The transfer id a notification names (unverified), or None for one not of this form."""
    tid, dot, mac = msg.decode(errors="replace").rpartition(".")
    return tid if dot and tid and len(mac) == 32 else None


def verifies(token: bytes, msg: bytes, agent: str, nonce: str) -> bool:
    """Whether `msg`, from `agent`, is the notification for the claim P answered `nonce` to."""
    tid = transfer_id(msg)
    return tid is not None and hmac.compare_digest(msg, make(token, tid, agent, nonce))
