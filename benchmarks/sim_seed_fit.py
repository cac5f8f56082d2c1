"""Fits the shipped B200 roofline profiles (pdserve/sim/profiles/{qwen3-0.6b,llama-3-8b}-b200.json) to the seed's
own published mean TPOT, and writes them with what was fitted to what (the profile's `fit` section).

    .venv/bin/python benchmarks/sim_seed_fit.py               # rewrites both profiles
    .venv/bin/python benchmarks/sim_seed_fit.py --models qwen3-0.6b --iterations 2

Fixed, not fitted: the model fields from the real architectures (benchmarks/sim_seed_table.py: ARCH), the GPU's
datasheet bandwidth and peak, the seed's workloads and vLLM's defaults. Fitted, per model:
- `step_overhead_s.FULL` and `gpu.memory_efficiency` to the six "after" mean TPOTs (default rule: D's steps are
  FULL graphs but for the residual);
- `step_overhead_s.PIECEWISE` to the six "before" mean TPOTs (strict rule: each arrival's replay step runs
  PIECEWISE), the two above held; `NONE` is set equal to it (no column tells it apart: NONE runs only steps past the
  largest capture size, P's prefills and D's recomputes).

How: a simulated request's TPOT is the sum of the D steps that emitted its tokens after the first, over their
count; every such step is overhead[mode] + bytes / (bandwidth x efficiency) when memory-bound (all decode steps
here), so the mean TPOT of a point is linear in (overheads, 1 / efficiency) for the batches the simulation formed.
Least squares on the relative error over the six points gives the parameters; the batches depend on them (a
slower step holds more requests), so the points are simulated again with the new parameters, `--iterations` times
(damped by half near the overloaded rows' feedback). The residuals reported are those of the last simulation.
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sim_seed_table import (ARCH, B200, PROFILE_NAME, SEED, WORKLOADS, engine_config,  # noqa: E402
                                       model_fields, trace_for, transfer_model)

MODES = ("FULL", "PIECEWISE", "NONE")
START = {"FULL": 1e-3, "PIECEWISE": 3e-3, "efficiency": 0.8}


def make_profile(key: str, o_full: float, o_pw: float, eff: float, fit: dict) -> dict:
    m = model_fields(ARCH[key])
    return {"type": "roofline", "name": PROFILE_NAME[key], "device": "cuda",
            "gpu": {**B200, "memory_efficiency": round(eff, 4)},
            "model": {k: m[k] for k in ("name", "kv_bytes_per_token", "weight_bytes", "flops_per_token",
                                        "attention_flops_per_pair", "max_model_len")},
            "step_overhead_s": {"FULL": round(o_full, 7), "PIECEWISE": round(o_pw, 7), "NONE": round(o_pw, 7)},
            "fit": fit}


def decompose(key: str, profile, isl: int, osl: int, rate: float, rule: str, seed: int = 0) -> dict:
    """Simulate one point; per request, the D steps between its first and last token as (steps by mode, bytes of
    memory-bound steps, seconds of compute-bound ones). Returns the simulated mean TPOT and the mean of those terms
    over (output tokens - 1), the design row of the least squares."""
    from pdserve.sim.run import parse_deployment, simulate
    ends, terms = [], []
    w, kvb = profile.weight_bytes, profile.model.kv_bytes_per_token

    def on_step(node, rec):
        if not node.name.startswith("decode") or not rec.mode:
            return
        ctx = pairs = 0
        for _, c, q in rec.rows:
            ctx += c + q
            pairs += q * c + q * (q + 1) // 2
        nbytes = w + kvb * ctx
        compute = (profile.flops_per_token * rec.padded_tokens + profile.attention_flops_per_pair * pairs) / \
            profile.peak_flops
        mem_bound = nbytes / profile.bandwidth >= compute
        ends.append(rec.end)
        terms.append((MODES.index(rec.mode), nbytes if mem_bound else 0.0, 0.0 if mem_bound else compute))
    r = simulate(trace_for(isl, osl, rate, seed), parse_deployment("1p1d"), engine_config(key, rule), profile,
                 transfer=transfer_model(profile), seed=seed, on_step=on_step)
    cum = np.zeros((len(terms) + 1, 5))  # prefix sums: FULL, PIECEWISE, NONE counts, bytes, compute seconds
    for i, (m, b, c) in enumerate(terms):
        cum[i + 1] = cum[i]
        cum[i + 1, m] += 1
        cum[i + 1, 3] += b
        cum[i + 1, 4] += c
    rows = []
    for start, ttft, lat, n in zip(r["start_times"], r["ttfts"], r["latencies"], r["output_lens"]):
        if n < 2:
            continue
        first, last = start + ttft, start + lat
        i, j = bisect.bisect_right(ends, first + 1e-12), bisect.bisect_right(ends, last + 1e-12)
        rows.append((cum[j] - cum[i]) / (n - 1))
    return {"tpot_ms": r["tpot_ms"]["mean"], "design": np.mean(rows, axis=0)}


def lstsq_rel(design: list[np.ndarray], target_ms: list[float], fixed: dict) -> dict:
    """Least squares on relative error for the free parameters (those not in `fixed`): FULL and PIECEWISE
    overheads (NONE tied to PIECEWISE), inverse bandwidth."""
    names = [k for k in ("FULL", "PIECEWISE", "inv_bw") if k not in fixed]
    a, b = [], []
    for d, t in zip(design, target_ms):
        cols = {"FULL": d[0], "PIECEWISE": d[1] + d[2], "inv_bw": d[3]}
        known = sum(fixed[k] * cols[k] for k in fixed) + d[4]
        a.append([cols[k] / (t / 1e3) for k in names])
        b.append(1.0 - known / (t / 1e3))
    x, *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    return dict(zip(names, (max(float(v), 0.0) for v in x)))


def fit_model(key: str, iterations: int, seed: int, link: dict | None = None) -> dict:
    """The profile with its step-time parameters fitted (simulating over `link`, the KV link of a previous fit, else
    the sim's default), then its KV link fitted over them."""
    from pdserve.sim.profile import profile_from_dict
    o_full, o_pw, eff = START["FULL"], START["PIECEWISE"], START["efficiency"]
    bw = B200["memory_bandwidth_gb_s"] * 1e9
    seed_tpot = {arm: [SEED[key][w][1][i] for w in WORKLOADS] for i, arm in enumerate(("before", "after"))}
    history = []
    for it in range(iterations):
        t0 = time.perf_counter()
        prof = profile_from_dict(make_profile(key, o_full, o_pw, eff, {"kv_transfer": link} if link else {}))
        after = [decompose(key, prof, *w, "decode-shaped", seed) for w in WORKLOADS]
        x = lstsq_rel([p["design"] for p in after], seed_tpot["after"], {"PIECEWISE": o_pw})
        new_full, new_eff = x["FULL"], min(1.0, 1.0 / (x["inv_bw"] * bw)) if x["inv_bw"] > 0 else 1.0
        before = [decompose(key, prof, *w, "strict", seed) for w in WORKLOADS]
        y = lstsq_rel([p["design"] for p in before], seed_tpot["before"], {"FULL": new_full,
                                                                           "inv_bw": 1.0 / (new_eff * bw)})
        history.append({"iteration": it, "FULL_s": o_full, "PIECEWISE_s": o_pw, "memory_efficiency": eff,
                        "after_tpot_ms": [p["tpot_ms"] for p in after],
                        "before_tpot_ms": [p["tpot_ms"] for p in before], "wall_s": time.perf_counter() - t0})
        print(f"[fit {key}] iteration {it}: FULL {1e3 * o_full:.3f} ms, PIECEWISE {1e3 * o_pw:.3f} ms, efficiency "
              f"{eff:.3f} -> after TPOT sim/seed " + ", ".join(
                  f"{p['tpot_ms']:.2f}/{s:.2f}" for p, s in zip(after, seed_tpot["after"])) + "; before " + ", ".join(
                  f"{p['tpot_ms']:.2f}/{s:.2f}" for p, s in zip(before, seed_tpot["before"]))
              + f" [{time.perf_counter() - t0:.0f} s]", flush=True)
        if it < iterations - 1:  # damped: the overloaded rows' batches answer the step time with a larger batch
            o_full, eff, o_pw = (o_full + new_full) / 2, (eff + new_eff) / 2, (o_pw + y["PIECEWISE"]) / 2
    last = history[-1]

    def residuals(sim, seedv):
        return [{"workload": f"{w[0]}/{w[1]} @ {w[2]:g} req/s", "sim_ms": round(s, 3), "seed_ms": t,
                 "rel_error": round(s / t - 1, 4)} for w, s, t in zip(WORKLOADS, sim, seedv)]
    fit = {"method": "benchmarks/sim_seed_fit.py: least squares on the relative error of the simulated mean TPOT, "
                     "1P1D, the seed's six workloads, iterated on the simulated batches",
           "source": "shared/seed/000_8cdcdb96ebb6b31e.txt, Pre-PR vs Post-PR, " + ARCH[key]["hf"] + ", B200",
           "fitted": {"step_overhead_s.FULL, gpu.memory_efficiency": "mean TPOT, after (default rule), 6 rows",
                      "step_overhead_s.PIECEWISE": "mean TPOT, before (strict rule), 6 rows, the others held",
                      "step_overhead_s.NONE": "set equal to PIECEWISE (no column tells it apart)"},
           "iterations": iterations,
           "kv_transfer_while_fitting": link or "the sim's default (1 ms, 12.5 GB/s)",
           "residuals_after": residuals(last["after_tpot_ms"], seed_tpot["after"]),
           "residuals_before": residuals(last["before_tpot_ms"], seed_tpot["before"])}
    prof = make_profile(key, last["FULL_s"], last["PIECEWISE_s"], last["memory_efficiency"], fit)
    fit["kv_transfer"] = fit_link(key, prof, seed)
    return prof


LINK_ROWS = ((1024, 256, 8), (4096, 1024, 4))  # the lowest rate of each length: TTFT is the path, not a queue


def fit_link(key: str, prof: dict, seed: int, rounds: int = 3) -> dict:
    """The KV link (latency, bandwidth) that puts the simulated median TTFT of LINK_ROWS (after) on the seed's:
    simulated first with a link of no cost, the rest of each TTFT (P's prefill, D's replay step) is known, and the
    two rows' remainders give latency + prompt bytes / bandwidth, two equations in two unknowns; solved again from
    each check's own rest (the median moves with D's step boundaries too), `rounds` times. The latency holds
    whatever the simulation has no model of on that path (the proxy's two HTTP hops, NIXL's handshake and
    notifications), the bandwidth any P prefill cost past the roofline's; the other rows' TTFT are not fitted."""
    from pdserve.sim.profile import profile_from_dict
    idx = [WORKLOADS.index(w) for w in LINK_ROWS]
    seed_ttft = [SEED[key][WORKLOADS[i]][4][1] for i in idx]
    kvb = prof["model"]["kv_bytes_per_token"]
    nbytes = [(w[0] - 1) * kvb for w in LINK_ROWS]  # D imports n - 1 tokens and replays the last
    link = {"latency_ms": 0.0, "bandwidth_gb_s": 1e9}  # no cost: the first round's TTFT is the rest alone
    for _ in range(rounds):
        check = [simulate_ttft(key, profile_from_dict({**prof, "fit": {"kv_transfer": link}}), w, seed)
                 for w in LINK_ROWS]
        cost = [link["latency_ms"] + b / (link["bandwidth_gb_s"] * 1e6) for b in nbytes]  # ms
        rem = [s - (c - k) for s, c, k in zip(seed_ttft, check, cost)]  # what the link must cost, ms
        inv_bw = (rem[1] - rem[0]) / (nbytes[1] - nbytes[0])  # ms per byte
        latency = rem[0] - inv_bw * nbytes[0]
        if inv_bw <= 0 or latency < 0:
            raise SystemExit(f"[fit {key}] no link fits: remainders {rem} ms for {nbytes} bytes")
        link = {"latency_ms": round(latency, 3), "bandwidth_gb_s": round(1e-6 / inv_bw, 3)}
    check = [simulate_ttft(key, profile_from_dict({**prof, "fit": {"kv_transfer": link}}), w, seed)
             for w in LINK_ROWS]
    link.update(kv_lease_seconds=480.0, rounds=rounds,
                fitted_to="median TTFT, after, " + ", ".join(f"{w[0]}/{w[1]} @ {w[2]} req/s" for w in LINK_ROWS),
                residuals=[{"workload": f"{w[0]}/{w[1]} @ {w[2]:g} req/s", "sim_ms": round(c, 3), "seed_ms": s,
                            "rel_error": round(c / s - 1, 4)} for w, c, s in zip(LINK_ROWS, check, seed_ttft)])
    print(f"[fit {key}] KV link: latency {link['latency_ms']:.2f} ms, {link['bandwidth_gb_s']} GB/s -> median TTFT "
          "sim/seed " + ", ".join(f"{c:.2f}/{s:.2f}" for c, s in zip(check, seed_ttft)), flush=True)
    return link


def simulate_ttft(key: str, profile, w: tuple, seed: int) -> float:
    from pdserve.sim.run import parse_deployment, simulate
    r = simulate(trace_for(*w, seed), parse_deployment("1p1d"), engine_config(key, "decode-shaped"), profile,
                 transfer=transfer_model(profile), seed=seed)
    return r["ttft_ms"]["median"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-0.6b,llama-3-8b")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(ROOT / "pdserve/sim/profiles"))
    p.add_argument("--link-only", action="store_true",
                   help="Keep the profiles' step-time parameters; fit only the KV link (fit.kv_transfer).")
    args = p.parse_args()
    for key in args.models.split(","):
        out = Path(args.out_dir) / f"{PROFILE_NAME[key]}.json"
        if args.link_only:
            prof = json.loads(out.read_text())
            prof["fit"]["kv_transfer"] = fit_link(key, prof, args.seed)
        else:
            # the link of the profile there now, if any: the TPOT fit's simulations then run over the link it ships
            old = json.loads(out.read_text()).get("fit", {}).get("kv_transfer") if out.is_file() else None
            prof = fit_model(key, args.iterations, args.seed,
                             {k: old[k] for k in ("latency_ms", "bandwidth_gb_s")} if old else None)
        out.write_text(json.dumps(prof, indent=1) + "\n")
        print(f"[fit {key}] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
