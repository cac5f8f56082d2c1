"""`pdserve router`'s command line: its flags, the checks that refuse a bad one by name, and the uvicorn run.
What the router does with a request is in router.py's docstring (`python -m pdserve.router.cli --help`)."""
from __future__ import annotations

import argparse
import logging
from typing import Optional
from urllib.parse import urlsplit

from pdserve.router import app as _router
from pdserve.serve.request_context import exit_cleanly_after_signals


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="Prefill node base URLs (http[s]://host:port). Left out, the router fronts a collocated "
                        "pool (vllm-router's plain mode): each request is served whole by one --decode node, any "
                        "`pdserve serve`, picked by --policy, with the same health checks and migration.")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="Decode node base URLs (http[s]://host:port); without --prefill, the collocated nodes.")
    p.add_argument("--host", default="127.0.0.1", help="Bind address (default: 127.0.0.1).")
    p.add_argument("--port", type=int, default=8000, help="Port (default: 8000).")
    p.add_argument("--policy", choices=("round-robin", "least-loaded"), default="round-robin",
                   help="How a P and a D are chosen among the healthy ones (default: round-robin).")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="Seconds between node health checks and P -> D probes (default: 1.0).")
    p.add_argument("--pd-first-token", choices=("replay", "prefill"), default="replay",
                   help="Where a P/D request's first token comes from. 'replay' (default, vLLM's way): P prefills with "
                        "max_tokens 1 and D replays the last prompt token before its first token. 'prefill': P "
                        "samples the first token with the request's own params and the router streams it to the "
                        "client as soon as P answers; D imports all prompt KV and decodes from that token (lower "
                        "TTFT). A first token that ends the request is answered by P alone.")
    p.add_argument("--pd-early-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="With --pd-first-token prefill (pdserve decode nodes): a streamed request's decode node is "
                        "asked at the same time as its prefill node and takes P's params and KV from P itself the "
                        "moment P's request ends (on P's KV channel with the tcp connector, else GET "
                        "/v1/kv/handoff/KEY; authenticated with the KV token), so the gap between P's first token "
                        "and D's first is not also the router's hop, D's tokenizing and the KV pull. D asks only "
                        "its kv_peers (loopback when it has none). Default: on (it lowered the first-token arm's "
                        "p99 ITL in 11 of 12 bench pd pairs, at a median 11% more TTFT where P, D and the router "
                        "shared 2 cores; docs/pd.md); --no-pd-early-decode asks D after P answered, with P's params "
                        "in the body.")
    p.add_argument("--max-migrations", type=int, default=_router.MAX_MIGRATIONS,
                   help="How many times one request's answer may move to another node when its node fails "
                        "(default: %(default)s). A stream broken off mid-way resumes on another decode node (or a "
                        "prefill node) from the tokens the client already has: no token is repeated or lost, and "
                        "greedy and seeded output equal an unbroken run; a whole answer is asked again. 0 turns "
                        "migration off: a stream whose node fails then ends with an error event.")
    p.add_argument("--prefill-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="With no healthy decode node (all down, stalled past a health check, or failing), a healthy "
                        "prefill node serves requests whole, collocated, instead of the client getting 503 "
                        "(default: on; counted in pdserve_router_prefill_fallbacks_total). A prefill node that "
                        "decodes serves its prefills slower meanwhile: --no-prefill-fallback keeps prefill nodes "
                        "to prefill and answers 503 while no decode node is up.")
    p.add_argument("--max-body-bytes", type=int, default=_router.MAX_BODY_BYTES,
                   help="Largest request body in bytes; a larger one is refused with 413 before it is read whole "
                        "or sent to a node (default: 16 MiB, as pdserve serve's).")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"),
                   help="Log level (default: info).")


def check_router_args(args) -> None:
    """What uvicorn or the health loop would take badly, refused naming the flag: an empty --host listens on
    every interface, a port over 65535 wraps around, a zero interval spins."""
    if not args.host.strip():
        raise ValueError("--host must not be empty (0.0.0.0 listens on every interface, if that is meant)")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_migrations < 0:
        raise ValueError(f"--max-migrations must be >= 0, got {args.max_migrations}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if not 0 < args.health_interval < float("inf"):
        raise ValueError(f"--health-interval must be a positive number of seconds, got {args.health_interval}")
    if args.pd_first_token == "prefill" and not args.prefill:
        raise ValueError("--pd-first-token prefill needs --prefill nodes (P samples the first token); without them "
                         "every request is served whole by a --decode node")
    for flag, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
        for url in urls:
            if (why := _bad_url(url)) is not None:
                raise ValueError(f"{flag}: {url!r} is not a node URL ({why}); e.g. http://127.0.0.1:8100")


def _bad_url(url: str) -> Optional[str]:
    try:
        u = urlsplit(url)
    except ValueError as e:
        return str(e)
    try:
        port = u.port
    except ValueError:  # not a number, or out of range
        return "the port must be in 1..65535"
    if u.scheme not in ("http", "https"):
        return "the scheme must be http or https"
    if not u.hostname:
        return "no host"
    if port is not None and not 0 < port < 65536:
        return "the port must be in 1..65535"
    if u.query or u.fragment:
        return "a base URL has no query or fragment: the router appends /v1/... to it"
    if u.path.rstrip("/").endswith("/v1"):
        return "give the node's base URL, without /v1: the router appends /v1/... to it"
    return None


def run_router(args) -> int:
    import uvicorn
    check_router_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = _router.Router(args.prefill, args.decode, args.policy, args.health_interval,
                            pd_first_token=args.pd_first_token, max_migrations=args.max_migrations,
                            prefill_fallback=args.prefill_fallback, early_decode=args.pd_early_decode)
    router.max_body_bytes = args.max_body_bytes
    exit_cleanly_after_signals()  # as `pdserve serve`: 0 after a clean SIGTERM, not 143
    uvicorn.run(_router.build_app(router), host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve router", description=_router.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_router_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_router(args)
    except ValueError as e:
        parser.exit(2, f"pdserve router: error: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
