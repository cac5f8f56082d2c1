"""D's admission check of remote-prefill params: before a P/D request enters the scheduler, P is asked (over the KV
session, on a worker thread of that P's own, so the engine loop never waits on the network and a P that hangs
delays only its own requests) how long it still holds the KV the
params name. An authentic proof is not a fresh one: params replayed after their load, or held past their lease,
would otherwise send D to P for KV that is gone. The answer decides, on the engine loop:
- seconds left > 0: the request is admitted as usual;
- 0 (P released it, it expired while this node stalled, or P never made it, e.g. restarted): admitted with no
  load, prefilled here whatever the failure policy (the client did nothing wrong), and a bare `done` to P;
- P could not be asked (unreachable, handshake refused): admitted all the same, and the load's own failure policy
  (recompute here, or fail) decides, as for a P that dies after admission.
An abort while the question is out drops the request when the answer comes.
"""
from __future__ import annotations

import logging
import queue
from typing import Callable, Optional

from pdserve.transfer.channel.peer_workers import PeerWorkers, peer_of

logger = logging.getLogger("pdserve.serve.engine")
UNREACHABLE = None  # the answer when P could not be asked


class LeaseChecks:
    def __init__(self, ask: Callable[[dict], float], workers: int = 4):
        self._ask = ask
        self._pool = PeerWorkers(workers, "pdserve-lease-check")  # per P: a hung one holds up only its own
        self._answers: queue.Queue = queue.Queue()
        self._open: dict[str, bool] = {}  # request id -> still wanted (False once aborted)

    @property
    def pending(self) -> bool:
        return bool(self._open)

    @property
    def num_waiting(self) -> int:
        """Requests still wanted whose P has not answered: waiting, though not in the scheduler yet."""
        return sum(self._open.values())

    def submit(self, rid: str, params: dict, cmd) -> None:
        self._pool.submit(peer_of(params), self._run, rid, params, cmd)  # raises: nothing left open for it
        self._open[rid] = True

    def _run(self, rid: str, params: dict, cmd: tuple) -> None:
        try:
            left = float(self._ask(params))
        except Exception as e:  # noqa: BLE001  (any failure to ask is "unreachable": the load's policy decides)
            logger.warning("could not ask the prefill node about its KV lease (%s: %s); admitting the request",
                           type(e).__name__, e, extra={"request_id": rid})
            left = UNREACHABLE
        self._answers.put((rid, cmd, left))

    def cancel(self, rid: str) -> bool:
        """True if `rid` was waiting for its answer (it is dropped when the answer comes)."""
        if rid in self._open:
            self._open[rid] = False
            return True
        return False

    def cancel_all(self) -> list[str]:
        rids = [rid for rid, wanted in self._open.items() if wanted]
        for rid in rids:
            self._open[rid] = False
        return rids

    def answers(self, wait: float = 0.0) -> list[tuple[tuple, Optional[float], bool]]:
        """(the add command, seconds left or UNREACHABLE, still wanted) for each answer in; waits up to `wait` s
        for the first one."""
        out = []
        try:
            item = self._answers.get(timeout=wait) if wait > 0 else self._answers.get_nowait()
            while True:
                rid, cmd, left = item
                out.append((cmd, left, self._open.pop(rid, False)))
                item = self._answers.get_nowait()
        except queue.Empty:
            pass
        return out

    def shutdown(self) -> None:
        self._pool.shutdown()
