"""D's record of P's NIXL agents: each added once, counted per use, removed once suspect and unused.

An agent's metadata only ever travels over an authenticated session (the caller fetches it). A use is a load that
resolved the agent, from its claim until its read ends. An agent is suspect once a read of it failed or its P
moved to a new agent (restarted on the same address); it is removed only when no use is left, because remove_peer
would force-release reads still in flight, which go on writing.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable


class AgentPeers:
    """Thread-safe: loader threads add and use agents, the poller releases them."""

    def __init__(self, agent):
        self.agent = agent
        self._lock = threading.Lock()  # one add_peer per agent
        self._by_endpoint: dict[tuple, str] = {}  # P's control endpoint -> its agent's name, once added
        self._users: Counter = Counter()  # agent name -> uses not yet released
        self._suspect: set[str] = set()

    def use(self, endpoint: tuple, name: str, fetch: Callable[[], tuple]) -> None:
        """One more use of agent `name`, P's at `endpoint`; `fetch()` -> add_peer's arguments, called only while
        the agent is unknown here, outside the lock (it is a round trip to P)."""
        meta = None
        while True:
            with self._lock:
                if name in self.agent.peers or meta is not None:
                    if name not in self.agent.peers:
                        old = self._by_endpoint.get(endpoint)
                        self.agent.add_peer(*meta)
                        self._by_endpoint[endpoint] = name
                        if old is not None and old != name:  # P restarted: its old agent goes once no read needs it
                            self._suspect.add(old)
                            self._forget_if_unused(old)
                    self._users[name] += 1
                    return
            meta = fetch()

    def release(self, name: str, suspect: bool = False) -> None:
        """One use of agent `name` ended; `suspect`: a read of it failed."""
        with self._lock:
            self._users[name] -= 1
            if suspect:
                self._suspect.add(name)
            self._forget_if_unused(name)

    def _forget_if_unused(self, name: str) -> None:  # under _lock
        if name in self._suspect and self._users[name] <= 0:
            self._suspect.discard(name)
            del self._users[name]
            self._by_endpoint = {k: v for k, v in self._by_endpoint.items() if v != name}
            self.agent.remove_peer(name)
