"""Request-id reuse and misdirected kv_transfer_params never reach another request's KV or crash a node."""
import pytest

from pdserve import SamplingParams
from tests.server_harness import free_port
from tests.transfer.test_pd_engine import consumer, producer


def test_reused_id_is_refused_while_its_kv_is_leased(qwen3_tiny):
    p = producer(qwen3_tiny, free_port())
    try:
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        p.engine.add_request("def f(x):\n" * 4, sp, request_id="X", kv_transfer_params={"do_remote_decode": True})
        while p.engine.scheduler.has_unfinished():
            p.engine.step()
        assert "X" in p.engine.scheduler.transfers.leased
        leased = list(p.engine.kv.req_blocks["X"])
        with pytest.raises(ValueError, match="'X' is still in use"):
            p.engine.add_request("import os", sp, request_id="X")
        assert p.engine.kv.req_blocks["X"] == leased  # the lease's blocks are untouched
        p.engine.add_request("import os", sp, request_id="Y")  # a fresh id is fine
    finally:
        p.engine.shutdown()


def test_do_remote_decode_sent_to_a_decode_node_is_refused(qwen3_tiny):
    d = consumer(qwen3_tiny)
    try:
        with pytest.raises(ValueError, match="do_remote_decode sent to a decode node"):
            d.engine.add_request("x y z", SamplingParams(max_tokens=2), kv_transfer_params={"do_remote_decode": True})
        assert not d.engine.has_unfinished_requests()
    finally:
        d.engine.shutdown()


def test_multiconnector_children_inherit_token_and_tls():
    from pdserve.kv_transfer_config import KVTransferConfig
    cfg = KVTransferConfig.from_dict({
        "kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_auth_token": "s3cret",
        "connectors": [{"kv_connector": "TcpConnector", "kv_role": "kv_producer"},
                       {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_auth_token": "own"}]})
    assert [c.kv_auth_token for c in cfg.connectors] == ["s3cret", "own"]


def test_router_refuses_before_prefill_when_no_decode_node_is_healthy():
    import socket

    from starlette.testclient import TestClient

    from pdserve.router.app import Router, build_app
    with socket.create_server(("127.0.0.1", 0)) as p_listener:  # a P that records whether anyone dialled it
        p_listener.settimeout(0.3)
        p_url = f"http://127.0.0.1:{p_listener.getsockname()[1]}"
        router = Router([p_url], [f"http://127.0.0.1:{free_port()}"], "round-robin", prefill_fallback=False)
        router.decode.nodes[0].healthy = False
        r = TestClient(build_app(router)).post("/v1/completions", json={"model": "m", "prompt": "hello there"})
        assert r.status_code == 503 and "no healthy decode node" in r.json()["error"]["message"]
        with pytest.raises(socket.timeout):
            p_listener.accept()  # P was never asked to prefill
