"""A sample of random workloads on the real tiny model in float64: every greedy output must equal the same prompt run
alone (an eager engine with a roomy pool, one request at a time), under each full_graph_rule, with random block
sizes, pools, chunking, prefix caching, shared prefixes and D-side arrivals (add_prefilled_request). float64 makes
the tokens independent of how rows were batched, padded or grouped."""
from __future__ import annotations

import random

from pdserve.config import EngineConfig
from pdserve.sched_output import cdiv
from pdserve.sampling_params import SamplingParams
from pdserve.worker.cudagraph_dispatch import RULES
from tests.fuzz.driver import Failure, _label_error


class Alone:
    """Greedy outputs of prompts run one at a time on an eager float64 engine (cached)."""

    def __init__(self, model_dir: str, max_model_len: int):
        from pdserve.core.engine import LLMEngine
        self.engine = LLMEngine(EngineConfig.from_kwargs(model_dir, dtype="float64", device="cpu", enforce_eager=True,
                                                         max_model_len=max_model_len, enable_prefix_caching=False,
                                                         kv_cache_memory_gb=0.05))
        self.cache: dict = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        have = self.cache.get(key, [])
        if len(have) < max_tokens:
            e = self.engine
            e.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), "alone")
            out = None
            while e.has_unfinished_requests():
                out = next((o for o in e.step() if o.finished), out)
            have = self.cache[key] = out.outputs[0].token_ids
        return have[:max_tokens]


def gen_real_case(r: random.Random, rule: str, vocab: int, max_len: int) -> dict:
    bs = r.choice((1, 2, 16, 32))
    mml = r.randint(17, max_len)
    per_seq = cdiv(mml, bs)
    seqs = r.choice([1, 2, 4, 8])
    chunked = r.random() < 0.6
    cfg = dict(block_size=bs, max_model_len=mml, num_gpu_blocks_override=per_seq + 1 + r.choice([0, 2, per_seq * 2]),
               enable_prefix_caching=r.random() < 0.6, enable_chunked_prefill=chunked, max_num_seqs=seqs,
               max_num_batched_tokens=r.choice([7, 32, 512]) if chunked else max(mml, 512), full_graph_rule=rule)
    if r.random() < 0.5:  # a P/D consumer, so prompt-tail applies to the D-side arrivals' replays
        cfg["kv_transfer_config"] = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_consumer"}
    reqs = []
    for _ in range(r.randint(2, 5)):
        n = max(1, min(mml - 2, r.choice([1, bs, bs + 1, 2 * bs, r.randint(2, 40), r.randint(2, mml)])))
        if reqs and r.random() < 0.4:
            base = r.choice(reqs)["prompt"]
            prompt = (base[:r.choice([len(base), len(base) // bs * bs, r.randint(1, len(base))])] +
                      [r.randrange(3, vocab) for _ in range(n)])[:n] or [5]
        else:
            prompt = [r.randrange(3, vocab) for _ in range(n)]
        kind = "prefilled" if len(prompt) >= 2 and r.random() < 0.4 else "local"
        reqs.append({"prompt": prompt, "max_tokens": r.randint(1, min(8, mml - len(prompt))), "kind": kind})
    return {"cfg": cfg, "reqs": reqs}


def run_real_case(case: dict, model_dir: str, alone: Alone) -> list[Failure]:
    from pdserve.core.engine import LLMEngine
    engine = LLMEngine(EngineConfig.from_kwargs(model_dir, dtype="float64", device="cpu", **case["cfg"]))
    fails, done = [], {}
    for i, q in enumerate(case["reqs"]):
        sp = SamplingParams(temperature=0, max_tokens=q["max_tokens"], ignore_eos=True)
        try:
            (engine.add_prefilled_request if q["kind"] == "prefilled" else engine.add_request)(q["prompt"], sp, f"r{i}")
        except RuntimeError:  # no room for the import now: add_prefilled_request's documented answer
            continue
    for step in range(2000):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    else:
        fails.append(Failure("livelock", "NEW", "real model: not done after 2000 steps"))
    for rid, o in sorted(done.items()):
        q = case["reqs"][int(rid[1:])]
        if o.outputs[0].finish_reason == "error":
            fails.append(Failure("error", _label_error(o.error or ""), f"real model {rid}: {o.error}"))
        elif o.outputs[0].token_ids != alone(q["prompt"], q["max_tokens"]):
            fails.append(Failure("oracle", "NEW", f"real model {rid} ({q['kind']}, prompt {len(q['prompt'])}): "
                                 f"{o.outputs[0].token_ids} != alone {alone(q['prompt'], q['max_tokens'])}"))
    if engine.kv.num_free_blocks() != engine.num_blocks - 1:
        fails.append(Failure("leak", "NEW", "real model: blocks not all free at the end"))
    return fails


def real_sample(model_dir: str, seed: int, per_rule: int = 2, max_len: int = 160) -> tuple[int, list]:
    """(workloads run, [(case, failure), ...]) over `per_rule` workloads for each full_graph_rule."""
    alone = Alone(model_dir, 2048)
    vocab = alone.engine.vocab_size
    r = random.Random(seed)
    out, n = [], 0
    for rule in RULES:
        for _ in range(per_rule):
            case = gen_real_case(r, rule, vocab, max_len)
            n += 1
            out += [(case, f) for f in run_real_case(case, model_dir, alone)]
    return n, out
