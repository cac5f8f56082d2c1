"""channel/handoffs.py's HandoffBoard without engines: P's engine posts once per key, KV server threads wait for it
(either may come first), posts are kept KEEP_SECONDS and at most MAX_POSTS."""
from __future__ import annotations

import threading
import time

from pdserve.transfer.channel.handoffs import HandoffBoard, read_params, params_payload, valid_key

K1, K2, K3 = "1" * 32, "2" * 32, "3" * 32


def test_a_wait_ends_when_the_post_comes():
    board, got = HandoffBoard(), []
    t = threading.Thread(target=lambda: got.append(board.wait(K1, 5.0)))
    t.start()
    time.sleep(0.05)
    board.post(K1, {"transfer_id": "t"}, "")
    t.join(2.0)
    assert got == [({"transfer_id": "t"}, "")]


def test_a_wait_with_no_post_is_pending_and_a_post_stays_for_another_wait():
    board = HandoffBoard()
    t0 = time.monotonic()
    assert board.wait(K1, 0.05) is None and time.monotonic() - t0 >= 0.05
    board.post(K1, None, "its first token ended the request")
    board.post(K1, {"transfer_id": "late"}, "")  # once per key: the second post changes nothing
    assert board.wait(K1, 0.0) == (None, "its first token ended the request")
    assert board.wait(K1, 0.0) == (None, "its first token ended the request")  # a redone await: the same answer


def test_posts_are_kept_keep_seconds_and_at_most_cap():
    board = HandoffBoard(keep=0.05, cap=2)
    board.post(K1, {"a": 1}, "")
    board.post(K2, {"b": 2}, "")
    board.post(K3, {"c": 3}, "")  # over the cap: the oldest goes
    assert board.wait(K1, 0.0) is None and board.wait(K3, 0.0) == ({"c": 3}, "") and len(board) == 2
    time.sleep(0.06)
    board.post("4" * 32, None, "x")  # posting sweeps what is older than keep
    assert len(board) == 1 and board.wait(K2, 0.0) is None


def test_params_travel_as_payload_and_keys_are_32_hex():
    assert read_params([memoryview(params_payload({"x": [1, 2]}))]) == {"x": [1, 2]}
    assert valid_key(K1) and not valid_key("A" * 32) and not valid_key(K1 + "0") and not valid_key(None)
