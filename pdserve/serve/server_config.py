"""Server options of `pdserve serve`: a frozen dataclass whose fields are the CLI flags (as the engine's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
EngineBackend = Literal["thread", "process"]


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "Address to listen on.")
    port: int = _f(8000, "TCP port to listen on.")
    served_model_name: tuple = _f((), "Model name(s) the API answers to; the first is reported in responses "
                                      "(default: the model directory's name).", cli=False)
    api_key: Optional[str] = _f(None, "Require `Authorization: Bearer <key>` on /v1 routes (default: "
                                      "$PDSERVE_API_KEY, else no key).")
    log_level: LogLevel = _f("info", "Log level of pdserve and uvicorn.")
    max_waiting: int = _f(1024, "Most queued requests (accepted, no token produced yet); more are refused with 503.")
    max_body_bytes: int = _f(16 * 2**20, "Largest request body in bytes; larger ones are refused with 413.")
    max_prompt_chars: Optional[int] = _f(None, "Longest text prompt in characters (a completions prompt, each of a "
                                               "batch, /tokenize's, or a chat's messages: their text plus one per "
                                               "message); longer ones are refused with 400 before they are "
                                               "tokenized. Default: 32 x max_model_len (text averages far fewer "
                                               "characters a token, so a longer prompt cannot fit the context "
                                               "unless truncate_prompt_tokens cuts it).")
    shutdown_timeout: float = _f(30.0, "On SIGTERM/SIGINT, seconds to let in-flight requests finish before they "
                                       "are aborted.")
    engine_stall_timeout: float = _f(30.0, "/health answers 503 once the engine loop has left a liveness ping "
                                           "unanswered this many seconds (it answers between steps, so only a stuck or "
                                           "stopped loop takes that long).")
    trust_request_chat_template: bool = _f(False, "Render a chat request's own Jinja template (`chat_template`, or "
                                                  "`chat_template_kwargs.chat_template`) instead of refusing it "
                                                  "with 400, as vLLM's flag: a template is code the server runs, "
                                                  "and a hostile one can run for ever (on a translation thread); "
                                                  "only for clients you trust.")
    enable_debug_routes: bool = _f(False, "Serve /debug/kv (KV block counts and the engine's invariant check).")
    engine_backend: EngineBackend = _f("process", "Where the engine loop runs: in its own process (its steps never "
                                                  "wait for the HTTP side's Python, and each step's outputs cross as "
                                                  "one msgpack frame), or on a background thread of the server "
                                                  "process (one process: for tests and embedding).")

    def validate(self) -> None:
        if not self.host.strip():  # uvicorn would listen on every interface: an unset variable, not a wish
            raise ValueError("host must not be empty (0.0.0.0 listens on every interface, if that is meant)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: leave --api-key out (and PDSERVE_API_KEY unset) for no key")
        if any(not n.strip() for n in self.served_model_name):
            raise ValueError("served_model_name: a name must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.shutdown_timeout >= 0:  # NaN too: the drain would fail at SIGTERM
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if not self.engine_stall_timeout > 0:
            raise ValueError(f"engine_stall_timeout must be > 0, got {self.engine_stall_timeout}")
