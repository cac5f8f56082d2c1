"""`pdserve` command line: make-model | generate | serve | router | bench serve | bench pd | sim | sim calibrate |
plan."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _make_model_parser(p) -> None:
    from pdserve.model.make_model import ARCHS, SIZES
    p.add_argument("--arch", choices=ARCHS, default="qwen3", help="Architecture (default: qwen3).")
    p.add_argument("--size", choices=SIZES, default="tiny",
                   help="tiny: ~4.5M parameters, for tests; small: ~116M, for benchmarks (default: tiny).")
    p.add_argument("--seed", type=int, default=0, help="Weight seed (default: 0).")
    p.add_argument("--out", default=None,
                   help="Output directory: new, empty, or a model make-model built, which is replaced; anything "
                        "else is refused (default: $PDSERVE_HOME/models/<arch>-<size>-s<seed>, PDSERVE_HOME "
                        "defaulting to ~/.cache/pdserve).")
    p.add_argument("--if-missing", action="store_true", help="Do nothing if --out already holds a complete model.")


def _generate_parser(p) -> None:
    from pdserve.config import ENGINE_SECTIONS, add_dataclass_args
    p.add_argument("--model", required=True, help="Local Hugging Face model directory.")
    p.add_argument("--prompt", action="append", default=None, help="A prompt; repeat the flag for a batch.")
    p.add_argument("--prompts-file", default=None, help="A text file with one prompt per line.")
    p.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    p.add_argument("--max-tokens", type=int, default=32, help="Tokens to generate per prompt (default: 32).")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 is greedy (default: 0).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default: 1.0).")
    p.add_argument("--top-k", type=int, default=0, help="Top-k sampling; 0 disables (default: 0).")
    p.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed (default: none).")
    p.add_argument("--ignore-eos", action="store_true", help="Keep generating past the EOS token.")
    for cls in ENGINE_SECTIONS:
        add_dataclass_args(p, cls)
    add_speculative_arg(p)


SPEC_HELP = ("Speculative decoding as vLLM's JSON, n-gram (prompt lookup) drafting: '{\"method\": \"ngram\", "
             "\"num_speculative_tokens\": K, \"prompt_lookup_min\": a, \"prompt_lookup_max\": b}' (K in 1..8; "
             "both bounds 5 when neither is given, one given copies it; optional disable_by_batch_size). "
             "Default: off.")


def add_speculative_arg(p) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON", help=SPEC_HELP)


def _engine_kwargs(args) -> dict:
    from pdserve.config import engine_kwargs_from_args
    kw = engine_kwargs_from_args(args)
    if args.speculative_config is not None:
        from pdserve.spec_decode.config import SpeculativeConfig
        kw["speculative_config"] = SpeculativeConfig.from_flag(args.speculative_config)
    return kw


def _serve_parser(p) -> None:
    from pdserve.config import ENGINE_SECTIONS, add_dataclass_args
    from pdserve.serve.server_config import ServerConfig
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Local Hugging Face model directory.")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Name(s) the API answers to; the first is reported in responses (default: the model "
                        "directory's name).")
    add_dataclass_args(p, ServerConfig)
    for cls in ENGINE_SECTIONS:
        add_dataclass_args(p, cls)
    if not any(a.dest == "kv_transfer_config" for a in p._actions):
        p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                       help="KV connector for P/D as JSON, vLLM-style (e.g. '{\"kv_connector\": \"TcpConnector\", "
                            "\"kv_role\": \"kv_producer\"}'); without it, requests with kv_transfer_params are "
                            "refused with 400.")
    for flag, field, doc in KV_FLAGS:
        p.add_argument(flag, default=None, help=f"{doc} Sets {field} of --kv-transfer-config.")
    add_speculative_arg(p)


KV_FLAGS = (("--kv-auth-token", "kv_auth_token", "Shared KV token (default: $PDSERVE_KV_TOKEN)."),
            ("--kv-tls-cert", "kv_tls_cert", "PEM certificate: P serves KV over TLS; on D, trusted when "
                                              "--kv-tls-ca is not given."),
            ("--kv-tls-key", "kv_tls_key", "PEM private key of --kv-tls-cert (P)."),
            ("--kv-tls-ca", "kv_tls_ca", "PEM CA bundle D verifies P's certificate against."),
            ("--pd-first-token", "pd_first_token",
             "P: 'prefill' hands D the first token P sampled with every request's KV (D decodes from it: no replay "
             "of the last prompt token); 'replay' (default, vLLM's way) only when the router asks for it."))


def _kv_transfer_config(args):
    """--kv-transfer-config with the --kv-* convenience flags folded in (the flags win)."""
    import json
    overrides = {field: getattr(args, field) for _, field, _ in KV_FLAGS if getattr(args, field, None) is not None}
    if not overrides:
        return args.kv_transfer_config
    if args.kv_transfer_config is None:
        flags = ", ".join("--" + k.replace("_", "-") for k in overrides)
        raise ValueError(f"{flags} only apply with --kv-transfer-config")
    try:
        kv = json.loads(args.kv_transfer_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
    if not isinstance(kv, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    return {**kv, **overrides}


def _exit_without_teardown(rc: int) -> int:
    """After the server has shut down: the exit handlers run and the streams are flushed, then the process leaves
    without the interpreter's teardown, which with torch loaded took ~0.7 s of freeing objects nobody reads again
    (every restart, rolling update and test waited for it)."""
    import atexit
    import logging
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def cmd_serve(args) -> int:
    import dataclasses
    from pdserve.config import EngineConfig
    from pdserve.serve.api_server import run_server
    from pdserve.serve.server_config import ServerConfig
    names = {f.name for f in dataclasses.fields(ServerConfig) if f.metadata.get("cli", True)}
    cfg = ServerConfig(**{k: v for k, v in vars(args).items() if k in names},
                       served_model_name=tuple(args.served_model_name or ()))
    cfg.validate()
    engine_config = EngineConfig.from_kwargs(args.model_dir, kv_transfer_config=_kv_transfer_config(args),
                                             **_engine_kwargs(args))
    return _exit_without_teardown(run_server(engine_config, cfg))


def _router_parser(p) -> None:
    from pdserve.router.cli import add_router_args
    add_router_args(p)


def cmd_router(args) -> int:
    from pdserve.router.cli import run_router
    return run_router(args)


def _bench_parser(p) -> None:
    from pdserve.bench.pd import add_bench_pd_args
    from pdserve.bench.serve import add_bench_serve_args
    bench = p.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_args(bench.add_parser(
        "serve", help="Load an OpenAI-compatible endpoint and report TTFT, TPOT, ITL, E2EL and throughput.",
        description="Load an OpenAI-compatible endpoint (pdserve, its router, or vLLM) with a random or jsonl "
                    "dataset at a request rate, and report vLLM's serving metrics; with a pdserve target, also the "
                    "run's share of non-FULL decode-graph steps."))
    add_bench_pd_args(bench.add_parser(
        "pd", help="Launch collocated and 1P1D deployments on loopback, sweep request rates, print the table.",
        description="The seed's experiment: launch each arm (collocated; 1P1D with the strict rule; 1P1D with the "
                    "default rule; ...) on loopback, run `bench serve` at each rate, tear down, and print the "
                    "before/after table with JSON results and PNG plots."))


def cmd_bench(args) -> int:
    from pdserve.bench.pd import run_bench_pd
    from pdserve.bench.serve import run_bench_serve
    try:
        if args.bench_command == "serve":
            return 0 if run_bench_serve(args)["failed"] == 0 else 1
        return run_bench_pd(args)
    except (RuntimeError, TimeoutError) as e:  # a target that fails every warm-up, an arm that would not start
        print(f"pdserve bench {args.bench_command}: {e}", file=sys.stderr)
        return 1


def _sim_parser(p) -> None:
    from pdserve.sim.cli import add_calibrate_args, add_sim_args
    add_sim_args(p)
    sim = p.add_subparsers(dest="sim_command", metavar="{calibrate}")
    add_calibrate_args(sim.add_parser(
        "calibrate", help="Measure this machine's engine on a model and fit a linear step-time profile.",
        description="Run the engine (graphs and eager) over a grid of batch sizes and prompt lengths, time every "
                    "step, and fit step time = base[mode] + a x padded tokens + b x rows + c x context tokens "
                    "by least squares; write the profile JSON."))


def cmd_sim(args) -> int:
    from pdserve.sim.cli import run_calibrate, run_sim
    return run_calibrate(args) if args.sim_command == "calibrate" else run_sim(args)


def _plan_parser(p) -> None:
    from pdserve.sim.cli import add_plan_args
    add_plan_args(p)


def cmd_plan(args) -> int:
    from pdserve.sim.cli import run_plan
    return run_plan(args)


def cmd_make_model(args) -> int:
    from pdserve.model.make_model import default_model_dir, is_complete, make_model
    if args.out is not None and not args.out.strip():
        raise ValueError("--out: empty path (leave the flag out for the default directory)")
    out = Path(args.out) if args.out is not None else default_model_dir(args.arch, args.size, args.seed)
    if args.if_missing and is_complete(out):
        print(f"model already at {out}")
        return 0
    make_model(out, args.arch, args.size, args.seed)
    print(out)
    return 0


def cmd_generate(args) -> int:
    from pdserve import LLM, SamplingParams
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompts-file")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.sampling_seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, **_engine_kwargs(args))
    t0 = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        print(f"--- prompt ({len(o.prompt_token_ids)} tokens): {p!r}")
        print(f"    output ({len(c.token_ids)} tokens, finish={c.finish_reason}): {c.text!r}")
    print(f"{len(prompts)} prompts, {n_out} output tokens in {dt:.2f} s: {n_out / dt:.1f} tokens/s "
          f"(device={llm.engine.device.type}, dtype={str(llm.engine.dtype).removeprefix('torch.')}, "
          f"async scheduling {'on' if llm.engine.async_scheduling else 'off'})")
    return 0


# name: (help, description, builder, handler). Only the named command's builder runs: the others' builders import
# their modules (the router's app alone ~0.5 s), and every server, router and bench process starts through here.
COMMANDS = {
    "make-model": ("Build a random-weight model with a locally trained tokenizer (HF layout).",
                   "Build a Qwen3- or Llama-shaped model with random weights (fixed seed) and a byte-level BPE "
                   "tokenizer trained on Python's standard library sources, in the Hugging Face layout. Nothing is "
                   "downloaded.", _make_model_parser, cmd_make_model),
    "generate": ("Generate completions offline for one or more prompts.",
                 "Run the engine offline (no server) on the given prompts and print the outputs and throughput.",
                 _generate_parser, cmd_generate),
    "serve": ("Serve a model over an OpenAI-compatible HTTP API.",
              "Start the OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health, "
              "/version, /metrics) for a local Hugging Face model directory.", _serve_parser, cmd_serve),
    "router": ("Route OpenAI requests through prefill (P) then decode (D) nodes.",
               "P/D router: each request is prefilled on a P (max_tokens=1, KV kept under a lease), then decoded on "
               "a D that pulls the KV; D's answer is streamed back.", _router_parser, cmd_router),
    "bench": ("Benchmark a serving endpoint (serve) or the P/D experiment end to end (pd).",
              "Serving benchmarks with vLLM's metric definitions.", _bench_parser, cmd_bench),
    "sim": ("Simulate a deployment (collocated or xPyD) over a trace with pdserve's own scheduler; `sim calibrate` "
            "fits a step-time profile.",
            "Discrete-event simulation: every node runs pdserve's own Scheduler, KV cache manager, block pool and "
            "graph dispatcher, the router's own pick policy in front; only the forward is a step-time profile and "
            "the KV transfer a bytes/bandwidth + latency model. Writes what `bench pd` writes (docs/sim.md).",
            _sim_parser, cmd_sim),
    "plan": ("Search the P:D split and node knobs for the most goodput per node (simulated).",
             "For a workload (a trace or bench serve's random generator) and SLOs (--goodput, vLLM's form), "
             "simulate every candidate deployment of --nodes nodes (collocated and each XpYd) under every "
             "combination of the knob lists, each over a sweep of request rates, and rank them by goodput per node "
             "(requests/s meeting every SLO, at the candidate's best rate, over its node count). Prints the "
             "ranking; writes plan.json, ranking.txt and plan.png (goodput against rate for the best few). "
             "docs/sim.md.", _plan_parser, cmd_plan),
}


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The whole parser, or, when argv names a command first, one whose other commands carry only their help line
    (what `pdserve --help` lists; `pdserve other --help` builds that one in full)."""
    argv = sys.argv[1:] if argv is None else argv
    named = argv[0] if argv and argv[0] in COMMANDS else None
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: a compact LLM serving engine for P/D "
                                     "disaggregation.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, description, build, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=description)
        if named in (None, name):
            build(p)
    return parser


def main(argv=None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command][3](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        name = args.command + (f" {args.bench_command}" if args.command == "bench" else
                               " calibrate" if getattr(args, "sim_command", None) == "calibrate" else "")
        parser.exit(2, f"pdserve {name}: error: {e}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
