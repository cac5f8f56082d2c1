"""Tokenize once: what a decode node's request translation costs with P's prompt ids in the params, and without.

    .venv/bin/python benchmarks/tokenize_once.py              # tiny model's tokenizer; writes
                                                              # benchmarks/results/tokenize_once.json

D's translation of a P/D request (`serve.protocol.to_generation_requests`, what runs on a worker thread before the
engine sees the request: validation, chat template, tokenizer, the checks) is timed for completions and chat prompts
of --lens tokens, once with params P signed with the prompt's ids (D checks the proof and the prompt input's digest
and uses them) and once with the same params signed without them (D renders and tokenizes, as before), alternating
one of each per round; medians over --rounds and the ratio with / without. P's params are made by P's own code (its
serving layer's digest, `leased_params`' fields, `sign_params`). Also: the params' JSON size with the packed ids,
and with the ids as a JSON list instead. The engine's check of the proof and the prompt hash is the same both ways and
is not in the figures. Single-threaded and short: run it on a quiet machine for figures to quote.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from pdserve.serve.prompts import ModelInfo
from pdserve.serve.protocol import to_generation_requests
from pdserve.transfer.channel.prompt_ids import PROMPT_INPUT_DIGEST, PROMPT_TOKEN_IDS, handoff_fields
from pdserve.transfer.channel.proof import PROOF_FIELD, prompt_hash, sign_params

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "benchmark-kv-token"
SOURCE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" \
         "The quick brown fox jumps over the lazy dog, and then it writes a sorting routine in Python. "


def text_of(tok, n: int) -> str:
    """A text of about n tokens (tokenizing a cut text may give a token more or less)."""
    ids = tok(SOURCE * (n // 20 + 2), add_special_tokens=False).input_ids
    return tok.decode(ids[:n])


def bodies(kind: str, text: str) -> tuple[dict, dict]:
    """(P's prefill body as a router sends it, D's body as the client wrote it)."""
    if kind == "chat":
        base = {"messages": [{"role": "system", "content": "You are a careful assistant."},
                             {"role": "user", "content": text}]}
    else:
        base = {"prompt": text}
    base |= {"model": "m", "max_tokens": 16, "temperature": 0}
    return {**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, base


def p_params(kind: str, p_body: dict, info: ModelInfo) -> dict:
    """P's signed params for the request, as its serving layer and leased_params make them."""
    greq = to_generation_requests("completion" if kind == "completion" else "chat", p_body, info)[0]
    req = SimpleNamespace(kv_transfer_params=greq.kv_transfer_params, prompt_token_ids=greq.prompt_token_ids)
    ids = greq.prompt_token_ids
    fields = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "0" * 32,
              "remote_engine_id": "prefill-0", "remote_request_id": "cmpl-0", "remote_host": "127.0.0.1",
              "remote_port": 14579, "remote_block_ids": list(range((len(ids) + 15) // 16)),
              "num_prompt_tokens": len(ids), "prompt_hash": prompt_hash(ids), "lease_seconds": 30.0,
              **handoff_fields(req)}
    return sign_params(fields, TOKEN)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/pdserve/models/qwen3-tiny-s0"))
    ap.add_argument("--lens", default="128,4096")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tokenize_once.json"))
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    info = ModelInfo(("m",), tok, len(tok), 8192, {}, True, kv_token=TOKEN)
    rows = []
    for n in (int(x) for x in args.lens.split(",")):
        for kind in ("completion", "chat"):
            p_body, d_body = bodies(kind, text_of(tok, n))
            with_ids = p_params(kind, p_body, info)
            without = sign_params({k: v for k, v in with_ids.items()
                                   if k not in (PROOF_FIELD, PROMPT_TOKEN_IDS, PROMPT_INPUT_DIGEST)}, TOKEN)
            arms = {"with": {**d_body, "kv_transfer_params": with_ids},
                    "without": {**d_body, "kv_transfer_params": without}}
            greqs = {arm: to_generation_requests(kind, body, info)[0] for arm, body in arms.items()}
            assert greqs["with"].ids_from_prefill and not greqs["without"].ids_from_prefill
            assert greqs["with"].prompt_token_ids == greqs["without"].prompt_token_ids
            times = {"with": [], "without": []}
            for r in range(args.rounds):
                for arm in (("with", "without") if r % 2 == 0 else ("without", "with")):
                    t0 = time.perf_counter()
                    to_generation_requests(kind, arms[arm], info)
                    times[arm].append(time.perf_counter() - t0)
            med = {arm: statistics.median(t) * 1e3 for arm, t in times.items()}
            ids = greqs["with"].prompt_token_ids
            as_list = {**{k: v for k, v in with_ids.items() if k != PROMPT_TOKEN_IDS}, "prompt_token_ids": ids}
            rows.append({"kind": kind, "prompt_tokens": len(ids), "median_ms_with_ids": round(med["with"], 4),
                         "median_ms_without_ids": round(med["without"], 4),
                         "ratio_with_over_without": round(med["with"] / med["without"], 4),
                         "params_bytes_without_ids": len(json.dumps(without)),
                         "params_bytes_with_packed_ids": len(json.dumps(with_ids)),
                         "params_bytes_with_ids_as_json_list": len(json.dumps(as_list))})
            print(f"{kind:10s} {len(ids):5d} tokens: {med['with']:8.3f} ms with P's ids, {med['without']:8.3f} ms "
                  f"tokenizing ({med['with'] / med['without']:.3f}x); params {rows[-1]['params_bytes_without_ids']}"
                  f" -> {rows[-1]['params_bytes_with_packed_ids']} B (a JSON list: "
                  f"{rows[-1]['params_bytes_with_ids_as_json_list']} B)")
    result = {"rows": rows, "rounds": args.rounds, "vocab_size": len(tok), "model": Path(args.model).name,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d")}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
