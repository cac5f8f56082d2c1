"""The engine loop's commands (serve/engine_commands.py) cross the process backend's pipe pickled: each comes back
equal, carries its values without copying them, and costs no more on the wire than its class and its values (no
field names, as a slotted dataclass's default pickle would write on every message)."""
from __future__ import annotations

import dataclasses
import pickle

from pdserve import SamplingParams
from pdserve.serve import engine_commands as ec

SAMPLES = [ec.AddRequest("r-1", [5, 6, 7], SamplingParams(max_tokens=4), 1.5, {"do_remote_prefill": True}, "salt"),
           ec.AbortRequest("r-1"), ec.AbortAll(), ec.ReleaseRemoteKV("r-1", {"transfer_id": "t"}), ec.Stop(),
           ec.GetStats(1), ec.Ping(2), ec.GetKVProbe(3), ec.GetLeases(4), ec.GetKVInfo(5),
           ec.ReleaseLease(6, {"transfer_id": "t"}), ec.CheckKVProbe(7, "p-7")]


def test_every_command_is_sampled_and_round_trips_through_pickle():
    classes = {c for c in vars(ec).values() if isinstance(c, type) and issubclass(c, ec._Message)}
    assert classes - {ec._Message, ec.Query} == {type(m) for m in SAMPLES}
    assert set(ec.QUERIES.values()) | set(ec.CALLS.values()) == {c for c in classes if issubclass(c, ec.Query)} - \
        {ec.Query}
    for m in SAMPLES:
        assert not hasattr(m, "__dict__"), m  # slotted
        data = pickle.dumps(m)
        back = pickle.loads(data)
        assert type(back) is type(m) and back == m
        for f in dataclasses.fields(m):  # a field name as pickle writes a short string: opcode, length, bytes
            assert b"\x8c" + bytes([len(f.name)]) + f.name.encode() not in data, (m, f.name)
        values = tuple(getattr(m, f.name) for f in dataclasses.fields(m))
        name = len(type(m).__module__) + len(type(m).__name__)
        assert len(data) <= len(pickle.dumps(values)) + name + 24, (m, len(data))  # 24: a frame header, opcodes


def test_a_command_holds_what_it_was_given_not_a_copy():
    tokens, params = [5, 6, 7], {"do_remote_prefill": True}
    m = ec.AddRequest("r", tokens, None, 0.0, params)
    assert m.prompt_token_ids is tokens and m.kv_transfer_params is params
    assert m.__reduce__()[1][1] is tokens  # pickling reads the fields, never deep-copies them (dataclasses.astuple)
