"""The separate host/device input path (CUDA's) on CPU: copies that run late, as a stream runs them, must still see
the step they were issued for. The fence is what makes that so."""
from __future__ import annotations

import torch

from pdserve import LLM, SamplingParams
from pdserve.sched_output import ScheduledRow
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams as SP
from pdserve.worker.input_batch import InputBuffers


class LateStaging:
    """A stream on the CPU: copies and kernels are queued, and run only when someone waits on them (the latest a
    GPU may run them). `ops` is the queue; `waits` counts fence waits that had something to wait for."""

    def __init__(self):
        self.ops, self.marks, self.waits = [], [], 0

    def copy(self, dst, src):
        self.ops.append(lambda: dst.copy_(src))

    def record(self):
        self.marks.append(len(self.ops))

    def wait(self):
        if self.marks:
            self.waits += 1
            self.run(self.marks[-1])

    def run(self, upto=None):
        upto = len(self.ops) if upto is None else upto
        todo, self.ops = self.ops[:upto], self.ops[upto:]
        self.marks = [m - upto for m in self.marks if m > upto]
        for op in todo:
            op()


def _row(rid, tokens):
    return ScheduledRow(Request(rid, tokens, SP(max_tokens=1)), 0, len(tokens))


def test_late_copies_see_their_own_step():
    """Two prefill-only steps back to back, nothing syncing in between (as on P): the first step's kernels, queued
    after its copies, must read the first step's ids and slots, not the second's."""
    st = LateStaging()
    b = InputBuffers(max_tokens=64, max_reqs=4, max_blocks_per_req=4, block_size=16, device=torch.device("cpu"),
                     staging=st)
    assert b.input_ids.data_ptr() != b.host["input_ids"].data_ptr()  # the device side is its own memory
    seen = []
    first = b.prepare([_row("a", [11, 12, 13])], {"a": [3]}.__getitem__)
    st.ops.append(lambda: seen.append((b.input_ids[:3].tolist(), b.slot_mapping[:3].tolist())))  # step 1's forward
    b.prepare([_row("b", [21, 22, 23, 24])], {"b": [5]}.__getitem__)
    st.run()
    assert seen == [([11, 12, 13], [48, 49, 50])]
    assert first.num_tokens == 3 and st.waits == 1


def test_separate_path_gives_the_same_tokens(qwen3_tiny):
    """The engine on the separate-buffer path (copies run at once, fences counted) equals the shared one."""
    prompts = ["def f(x):\n    return", "import os\n" * 7, "x"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(qwen3_tiny, max_model_len=256).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(qwen3_tiny, max_model_len=256)
    r, st = llm.engine.runner, LateStaging()
    old = r.buffers
    r.buffers = r.full_graphs.buffers = r.piecewise.buffers = InputBuffers(
        old.np_input_ids.shape[0], old.np_block_table.shape[0], old.max_blocks, old.block_size, old.device, staging=st)
    st.copy = lambda dst, src: dst.copy_(src)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert st.waits > 10
