"""Seeded random engine configs and workloads: a Case is plain JSON (config + requests), so a shrunk failure prints
and replays exactly.

A request: `at` (the step it arrives), `prompt` (token ids), `kind` (local | prefilled: add_prefilled_request, the
D-side arrival driver | remote: KV from the fake P), `sp` (SamplingParams fields), `abort` (a step, or None), `lease`
(remote: the fake P's lease steps and how the load ends).
"""
from __future__ import annotations

import random

from pdserve.sched_output import cdiv
from pdserve.sampling_params import SamplingParams
from pdserve.worker.cudagraph_dispatch import RULES
from tests.fuzz.expect import expect
from tests.fuzz.fake_model import VOCAB

BLOCK_SIZES = (1, 2, 16, 32)
MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE", "FULL")


def gen_config(r: random.Random) -> dict:
    bs = r.choice(BLOCK_SIZES)
    u = r.random()
    mml = r.randint(17, 64) if u < 0.45 else r.randint(65, 512) if u < 0.85 else r.randint(513, 4096)
    per_seq = cdiv(mml, bs)
    seqs = r.choice([1, 2, 3, 4, 8, 16, 64, r.randint(1, 64)])
    extra = r.choice([0, 0, 1, 2, r.randint(0, per_seq), per_seq * r.randint(1, 4)])
    chunked = r.random() < 0.7
    budget = r.choice([r.randint(1, 16), r.randint(16, 256), 2048])
    cfg = {"block_size": bs, "max_model_len": mml, "num_blocks": per_seq + 1 + extra,
           "prefix_caching": r.random() < 0.6, "chunked_prefill": chunked,
           "max_num_batched_tokens": budget if chunked else max(mml, seqs, budget), "max_num_seqs": seqs,
           "rule": r.choice(RULES), "mode": r.choices(MODES, [5, 2, 1, 1, 1])[0], "eager": r.random() < 0.1,
           "capture_max": r.choice([None, None, None, 1, 2, 4, 8, 32]), "seed": r.randint(0, 99), "kv": None}
    u = r.random()
    if u < 0.5:
        cfg["kv"] = {"connector": "fuzz", "policy": r.choice(["recompute", "fail"]), "timeout_steps": r.randint(1, 12)}
    elif u < 0.7:  # a P/D consumer without a connector (add_prefilled_request arrivals): the prompt-tail rule applies
        cfg["kv"] = {"connector": "bench"}
    # drawn last, so that the fields above keep the values they had for a seed before this field existed
    cfg["long_prefill"] = r.choice([0, 0, 0, 1, r.randint(2, 40)]) if chunked else 0
    cfg["async"] = r.random() < 0.5  # async scheduling (core/step_pipeline.py); a case saved before it ran without
    return cfg


def _length(r: random.Random, cfg: dict) -> int:
    bs, mml = cfg["block_size"], cfg["max_model_len"]
    k = r.randint(1, max(1, min(8, (mml - 2) // bs)))
    n = r.choice([1, k * bs, k * bs + 1, k * bs - 1, r.randint(2, min(mml - 1, 48)), r.randint(1, mml - 1),
                  mml - 1 if r.random() < 0.3 else 2])
    return max(1, min(n, mml - 1))


def gen_requests(r: random.Random, cfg: dict, chars: list[str], max_reqs: int = 24) -> list[dict]:
    mml, kv = cfg["max_model_len"], cfg["kv"] or {}
    count = r.choice([1, 2, 3, r.randint(1, 8), r.randint(1, max_reqs)])
    burst = r.random() < 0.5
    reqs, budget = [], 6000  # tokens to compute, about: keeps a workload to tens of milliseconds
    bs, usable = cfg["block_size"], cfg["num_blocks"] - 1
    if r.random() < 0.12 and (mml - 2) // bs >= 1 and usable * bs <= 2000:
        # Imports that fill the pool exactly, each a replay token past a block boundary (n - 1 = k blocks): the
        # decode-node livelock's shape. Remote loads on the fake connector, else the D-side arrival driver.
        kind = "remote" if kv.get("connector") == "fuzz" else "prefilled"
        while usable > 0 and len(reqs) < max_reqs:
            k = r.randint(1, min(usable, (mml - 2) // bs))
            usable -= k
            reqs.append({"at": 0, "prompt": [r.randrange(VOCAB) for _ in range(k * bs + 1)], "kind": kind,
                         "sp": {"temperature": 0.0, "max_tokens": r.randint(1, min(4, mml - k * bs - 1)), "seed": None},
                         "abort": None, "lease": None if kind == "prefilled" else
                         {"steps": 1000, "outcome": "ok", "latency": r.randint(1, kv["timeout_steps"])}})
        budget -= usable * bs
    for _ in range(count):
        n = _length(r, cfg)
        u = r.random()
        if reqs and u < 0.15:  # a repeat
            prompt = list(r.choice(reqs)["prompt"])
        elif reqs and u < 0.45:  # a shared prefix: a block-aligned cut or anywhere
            base = r.choice(reqs)["prompt"]
            cut = min(len(base), r.choice([len(base) // bs * bs, r.randint(1, len(base))]))
            prompt = base[:cut] + [r.randrange(VOCAB) for _ in range(max(0, n - cut))]
            prompt = prompt[:mml - 1] or [1]
        else:
            prompt = [r.randrange(VOCAB) for _ in range(n)]
        n = len(prompt)
        room = mml - n
        max_tokens = r.choice([r.randint(1, min(room, 8)), r.randint(1, min(room, 40)), 1,
                               None if room <= 48 else 16, room if room <= 64 else 3])
        budget -= n + (max_tokens or room)
        if budget < 0 and reqs:
            break
        sp = {"temperature": 0.0, "max_tokens": max_tokens, "seed": None}
        u = r.random()
        if u < 0.15:
            sp.update(temperature=r.choice([0.5, 1.0, 1.5]), seed=r.randint(0, 2**31))
        elif u < 0.22:
            sp.update(temperature=1.0)  # the engine's generator: only the structure is checked
        if r.random() < 0.2:
            sp["ignore_eos"] = True
        if r.random() < 0.25:
            sp["min_tokens"] = r.randint(0, max_tokens or room)
        if r.random() < 0.35:
            _add_stops(r, sp, prompt, mml, chars)
        kind = "local"
        if n >= 2 and kv.get("connector") == "fuzz" and r.random() < 0.6:
            kind = "remote"
        elif n >= 2 and r.random() < 0.2:
            kind = "prefilled"
        req = {"at": 0 if burst else r.randint(0, 24), "prompt": prompt, "kind": kind, "sp": sp,
               "abort": None, "lease": None}
        if r.random() < 0.12:
            req["abort"] = req["at"] + r.choice([0, 1, 2, r.randint(0, 30)])
        if kind == "remote":
            req["lease"] = {"steps": r.choice([1, 3, 10, 50, 1000]),
                            "outcome": r.choices(["ok", "fail", "hang"], [8, 1, 1])[0],
                            "latency": r.choice([1, 1, 2, 3, r.randint(1, kv["timeout_steps"] + 2)])}
        reqs.append(req)
    return reqs


def _add_stops(r: random.Random, sp: dict, prompt: list[int], mml: int, chars: list[str]) -> None:
    """Stop strings cut from the text the request would produce without them (so they hit), or random ones, and
    stop token ids taken from its tokens. No stop string is a suffix of another: when two end on the same character
    vLLM takes the first listed and this engine the longest, an ambiguity this test does not judge."""
    e = expect(prompt, make_params({**sp, "temperature": 0.0, "seed": None}), mml, chars)
    stops = []
    for _ in range(r.randint(1, 3)):
        if e.text and r.random() < 0.8:
            i = r.randrange(len(e.text))
            s = e.text[i:i + r.randint(1, 3)]
        else:
            s = "".join(r.choice(chars[3:]) for _ in range(r.randint(1, 2)))
        if all(not a.endswith(b) and not b.endswith(a) for a in stops for b in [s]):
            stops.append(s)
    if r.random() < 0.7:
        sp["stop"] = stops
        sp["include_stop_str_in_output"] = r.random() < 0.3
    if r.random() < 0.4:
        sp["stop_token_ids"] = [r.choice(e.tokens)] + ([2] if r.random() < 0.2 else [])


def make_params(sp: dict) -> SamplingParams:
    return SamplingParams(**sp)


def gen_case(seed: int, chars: list[str]) -> dict:
    r = random.Random(seed)
    cfg = gen_config(r)
    return {"seed": seed, "cfg": cfg, "reqs": gen_requests(r, cfg, chars)}


def engine_kwargs(cfg: dict) -> dict:
    kw = dict(block_size=cfg["block_size"], max_model_len=cfg["max_model_len"],
              num_gpu_blocks_override=cfg["num_blocks"], enable_prefix_caching=cfg["prefix_caching"],
              enable_chunked_prefill=cfg["chunked_prefill"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
              long_prefill_token_threshold=cfg.get("long_prefill", 0),
              max_num_seqs=cfg["max_num_seqs"], full_graph_rule=cfg["rule"], cudagraph_mode=cfg["mode"],
              enforce_eager=cfg["eager"], max_cudagraph_capture_size=cfg["capture_max"], seed=cfg["seed"],
              async_scheduling=cfg.get("async", False), device="cpu")
    kv = cfg.get("kv") or {}
    if kv.get("connector") == "fuzz":
        from tests.fuzz.fake_connector import NAME, TOKEN
        kw["kv_transfer_config"] = {"kv_connector": NAME, "kv_role": "kv_consumer", "kv_auth_token": TOKEN,
                                    "kv_load_failure_policy": kv["policy"],
                                    "kv_connector_extra_config": {"timeout_steps": kv["timeout_steps"]}}
    elif kv.get("connector") == "bench":
        kw["kv_transfer_config"] = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_consumer"}
    return kw
