"""Issue 37: the router reads a request body as it streams in and stops at --max-body-bytes (it read any body whole
before any check): a body over the limit is a 413 naming the flag, and no node is asked. Fake nodes, as in
test_router_failures.py."""
from __future__ import annotations

import argparse
import json

import pytest

from pdserve.router.cli import add_router_args, check_router_args
from pdserve.serve.body import DRAIN_SLACK
from pdserve.serve.server_config import ServerConfig
from tests.router.test_router_failures import P1, Nodes, ok_d, ok_p, routed
from tests.transfer.test_failure_paths_pd import asgi

LIMIT = 1000


def chunks(total: int, size: int = 1 << 16):
    body = json.dumps({"prompt": "x" * total, "max_tokens": 4}).encode()
    return [body[i:i + size] for i in range(0, len(body), size)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_over_the_limit_is_413_never_read_whole_and_never_sent_on(path):
    nodes = Nodes({P1: ok_p}, ok_d)
    with routed(nodes, [P1]) as c:
        c.router.max_body_bytes = LIMIT
        call = lambda **kw: c.portal.call(lambda: asgi(c.app, "POST", path, **kw))  # noqa: E731
        streamed = call(chunks=chunks(2 * DRAIN_SLACK))  # no length: read up to the limit and the slack only
        declared = LIMIT + DRAIN_SLACK + 1
        unread = call(chunks=chunks(declared), headers=[("content-length", str(declared))])
        for res in (streamed, unread):
            assert res["status"] == 413, res
            err = json.loads(res["body"])["error"]
            assert err["code"] == 413 and "--max-body-bytes" in err["message"] and str(LIMIT) in err["message"]
        assert LIMIT + DRAIN_SLACK < streamed["read"] <= LIMIT + DRAIN_SLACK + (1 << 16), streamed["read"]
        assert unread["read"] == 0
        assert nodes.calls == []
        within = {"prompt": "hi", "max_tokens": 4}
        r = c.post(path, json=within)
        assert r.status_code == 200, r.text



def test_the_flag_defaults_to_the_servers_limit():  # its refusal: tests/test_cli_refusals.py
    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    assert args.max_body_bytes == 16 * 2 ** 20 == ServerConfig().max_body_bytes
    check_router_args(args)
