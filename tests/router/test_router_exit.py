"""`pdserve router` exits 0 after a clean SIGTERM or SIGINT, as `pdserve serve` does (it exited 143: uvicorn re-raises
the signal it caught once it has shut down, and a supervisor reads death by signal as a crash)."""
import signal
import time

import httpx
import pytest

from tests.server_harness import RouterProcess, free_port


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signalled_router_exits_0(sig):
    nodes = [f"http://127.0.0.1:{free_port()}"]  # nobody there: the router starts and serves all the same
    router = RouterProcess(nodes, nodes)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # listening (its /health answers, 503 with no node up)
            try:
                httpx.get(router.url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert router.proc.poll() is None, router.proc.returncode
                time.sleep(0.2)
        router.proc.send_signal(sig)
        assert router.proc.wait(20) == 0
    finally:
        router.cleanup()
