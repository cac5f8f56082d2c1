"""The NIXL read-done notification's proof (transfer/nixl/notif.py): it verifies only for the claim it was made for
(the KV token, the transfer id, the claimant's agent and the claim's nonce); the end to end check, a forged
notification freeing nothing on P, is in test_nixl_connector.py."""
from __future__ import annotations

from pdserve.transfer.nixl import notif


def test_a_notification_verifies_only_for_its_own_claim():
    nonce = notif.new_nonce()
    msg = notif.make(b"tok", "cmpl-1.2.3", "D-agent", nonce)  # a transfer id may hold dots
    assert notif.transfer_id(msg) == "cmpl-1.2.3"
    assert notif.verifies(b"tok", msg, "D-agent", nonce)
    assert not notif.verifies(b"other", msg, "D-agent", nonce)
    assert not notif.verifies(b"tok", msg, "E-agent", nonce)
    assert not notif.verifies(b"tok", msg, "D-agent", notif.new_nonce())
    moved = b"cmpl-9." + msg.rpartition(b".")[2]  # the MAC of one transfer on another's id
    assert not notif.verifies(b"tok", moved, "D-agent", nonce)


def test_malformed_notifications_name_no_transfer():
    for msg in (b"", b"cmpl-1", b"cmpl-1.", b".0123456789abcdef0123456789abcdef", b"cmpl-1.abc", b"\xff\xfe"):
        assert notif.transfer_id(msg) is None, msg
        assert not notif.verifies(b"tok", msg, "D-agent", "n")
