"""Where AsyncEngine's engine loop (engine_core.py) runs (`--engine-backend`): on a thread of the server's process, or
in a child process of its own. Both take the server's commands from the same QueueInbox and hand every output of
the loop to one callback (`on_output`, called on a thread of theirs); they differ only in the transport between.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from pdserve.serve.engine_commands import Stop
from pdserve.serve.engine_core import EngineCore, QueueInbox, run_in_process
from pdserve.serve.engine_messages import Wire

logger = logging.getLogger("pdserve.serve.engine")


def _spawn(target, name: str) -> threading.Thread:
    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    return t


class ThreadBackend:
    """The engine loop on a thread of the server's process: the inbox is its own."""

    def __init__(self, engine_config, inbox: QueueInbox, on_output: Callable[[Any], None]):
        self.core = EngineCore(engine_config, inbox, on_output)
        self.threads = [_spawn(self.core.run, "pdserve-engine")]

    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


class ProcessBackend:
    """The engine loop in a child process: a writer thread sends the inbox's commands down one pipe (pickled: one
    message per request, small), a reader thread decodes what comes back up the other (one msgpack frame per step,
    engine_messages.Wire) and hands it on.

    The child starts at construction and the threads at `attach`: the server builds this before it loads its own
    tokenizer, so the engine imports torch and loads the model meanwhile (start-up took the sum of the two); what the
    child sends before `attach` waits in the pipe."""

    def __init__(self, engine_config, inbox: QueueInbox, log_level: str):
        import multiprocessing as mp
        self.inbox = inbox
        ctx = mp.get_context("spawn")
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_in_process, name="pdserve-engine", daemon=True,
                                args=(engine_config, cmd_recv, out_send, log_level))
        self.proc.start()
        cmd_recv.close()
        out_send.close()
        self.threads: list[threading.Thread] = []

    def attach(self, on_output: Callable[[Any], None]) -> None:
        self.on_output = on_output
        self.threads = [_spawn(lambda: self._read(self._out_recv), "pdserve-engine-reader"),
                        _spawn(lambda: self._write(self._cmd_send), "pdserve-engine-writer")]

    def alive(self) -> bool:
        return self.proc.is_alive() and bool(self.threads) and all(t.is_alive() for t in self.threads)

    def join(self, timeout: float) -> None:
        """Waits up to `timeout` s in all for the threads and the process; kills a process still there."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0.1))
        self.proc.join(max(deadline - time.monotonic(), 0.1))
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def _read(self, conn) -> None:
        wire = Wire()
        while True:
            try:
                obj = wire.decode(conn.recv_bytes())
            except (EOFError, OSError):
                self.on_output(RuntimeError("the engine process exited"))
                return
            except Exception as e:  # a frame that does not decode: its outputs are lost, so every request's
                # state is in doubt; end them all and the engine with them rather than let them wait forever
                logger.exception("an engine output could not be read")
                self.on_output(RuntimeError(f"an engine output could not be read ({type(e).__name__})"))
                self.proc.kill()
                return
            self.on_output(obj)

    def _write(self, conn) -> None:
        while True:
            for msg in self.inbox.get(block=True):
                try:
                    conn.send(msg)
                except (BrokenPipeError, OSError):
                    return
                if isinstance(msg, Stop):
                    return
