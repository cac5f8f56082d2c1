"""MultiConnector on a producer: a request several children keep is freed only when all of them have let go."""
from __future__ import annotations

from types import SimpleNamespace

from pdserve.transfer.base import ConnectorMeta, FinishedTransfers, KVConnector
from pdserve.transfer.factory import register_connector
from pdserve.transfer.multi import MultiConnector


class KeepingChild(KVConnector):
    """Keeps every finished request under a lease and lets go when the test says so."""

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.released: set[str] = set()

    def get_num_new_matched_tokens(self, req, num_local_computed):
        return 0

    def update_state_after_alloc(self, req, block_ids, num_local_computed):
        pass

    def build_connector_meta(self):
        return ConnectorMeta()

    def request_finished(self, req, block_ids):
        return True, {"from": self.config.kv_connector, "child": id(self)}

    def start_load_kv(self, meta):
        pass

    def get_finished(self):
        out, self.released = FinishedTransfers(done_sending=set(self.released)), set()
        return out


register_connector("_KeepingChild", __name__, "KeepingChild")

def test_blocks_freed_only_when_every_keeping_child_let_go():
    children = [SimpleNamespace(kv_connector="_KeepingChild") for _ in range(2)]
    multi = MultiConnector(SimpleNamespace(connectors=children), ctx=None)
    a, b = multi.children
    req = SimpleNamespace(request_id="r")
    keep, params = multi.request_finished(req, [1, 2])
    assert keep and params["child"] == id(a)  # the first child's params go to the client
    b.released.add("r")  # the other child's lease expired: a's reader may still be reading
    assert multi.get_finished().done_sending == set()
    a.released.add("r")
    assert multi.get_finished().done_sending == {"r"}
