"""What the server sends the engine loop (engine_core.py): one small dataclass per command, dispatched there by its
type, so a command's fields have names and a misspelt one fails where it is built. Queries carry the id their reply
comes back under (StepBatch.replies). The outputs the loop sends back are in engine_messages.py.

The process backend pickles each message onto a pipe, once per command, so they stay as cheap as the tuples they
replaced: slotted, never copied, and pickled as their class and their field values (see `_Message.__reduce__`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


class _Message:
    __slots__ = ()

    def __reduce__(self):
        # The class and its values in field order, as a tuple would carry them: the default pickle of a slotted
        # dataclass also writes every field's name, on every message. `__match_args__` is the dataclass's own list
        # of its (positional) fields, inherited ones first.
        return type(self), tuple(getattr(self, name) for name in self.__match_args__)


@dataclass(slots=True)
class AddRequest(_Message):
    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    arrival_time: float
    kv_transfer_params: Optional[dict] = None  # D: where P holds the prompt's KV (a P/D request)
    cache_salt: Optional[str] = None  # vLLM's cache_salt


@dataclass(slots=True)
class AbortRequest(_Message):
    request_id: str


@dataclass(slots=True)
class AbortAll(_Message):
    pass


@dataclass(slots=True)
class ReleaseRemoteKV(_Message):
    """D: a P/D request the server refused before the engine saw it; P's lease ends now if the params' proof holds."""
    request_id: str
    kv_transfer_params: Optional[dict]


@dataclass(slots=True)
class Stop(_Message):
    pass


@dataclass(slots=True)
class Query(_Message):
    """Answered between steps with a (query_id, result or exception) reply."""
    query_id: int


@dataclass(slots=True)
class GetStats(Query):
    pass


@dataclass(slots=True)
class Ping(Query):
    """Liveness: the loop answers between steps, so an unanswered ping means it is stuck inside one."""


@dataclass(slots=True)
class GetKVProbe(Query):
    pass


@dataclass(slots=True)
class GetLeases(Query):
    """P/D producer: how many finished prefills a decode node may still read."""


@dataclass(slots=True)
class GetKVInfo(Query):
    """The KV pool's use and whether its invariants hold."""


@dataclass(slots=True)
class ReleaseLease(Query):
    """P: a router ends a lease (KVGateway.release_lease)."""
    params: Any


@dataclass(slots=True)
class CheckKVProbe(Query):
    """A router checks a peer's KV probe (KVGateway.check_kv_probe)."""
    probe: Any


# AsyncEngine.query(name) and .call(name, arg) take these names (the server's routes use them).
QUERIES: dict[str, type[Query]] = {"stats": GetStats, "ping": Ping, "kv_probe": GetKVProbe, "leases": GetLeases,
                                   "kv": GetKVInfo}
CALLS: dict[str, type[Query]] = {"release_lease": ReleaseLease, "check_kv_probe": CheckKVProbe}
