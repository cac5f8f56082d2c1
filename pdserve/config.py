"""Engine configuration: frozen dataclasses whose fields are also the CLI flags.

Each field's `metadata["help"]` is its `--flag` help text, so the CLI never keeps a second, hand-written list.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import ssl
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

if TYPE_CHECKING:
    from pdserve.spec_decode.config import SpeculativeConfig

DType = Literal["auto", "float32", "float64", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "triton"]


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    model: str = _f("", "Path to a local Hugging Face model directory (Qwen3ForCausalLM or LlamaForCausalLM).", cli=False)
    dtype: DType = _f("auto", "Weight and activation dtype; 'auto' takes the checkpoint's (float32 on CPU for "
                               "half-precision checkpoints). float64 exists for exactness tests.")
    max_model_len: Optional[int] = _f(None, "Context length (prompt + output); default: the model's "
                                            "max_position_embeddings, capped at 4096.")
    seed: int = _f(0, "Seed for the engine's global sampling generator (requests with their own seed ignore it).")
    device: str = _f("auto", "Device: 'auto' (cuda if available, else cpu), 'cpu' or 'cuda[:N]'.")
    attention_backend: AttentionBackendName = _f("auto", "Attention kernels: torch (SDPA over gathered K/V), triton "
                                                 "(paged decode kernel reading each row's length; prefill through "
                                                 "SDPA), auto (triton on CUDA when installed, else torch).")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "Tokens per KV cache block.")
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of identical prompt prefixes (chained block hashes).")
    kv_cache_memory_gb: float = _f(1.0, "Memory for the KV cache in GiB (capped at what max_num_seqs full-length "
                                        "sequences need).")
    num_gpu_blocks_override: Optional[int] = _f(None, "Use exactly this many KV blocks (tests, benchmarks); "
                                                         "unset: sized from memory.")
    gpu_memory_utilization: Optional[float] = _f(None, "CUDA: the fraction of the GPU's memory this engine may use; "
                                                 "the KV cache gets what is left after the weights, a largest-step "
                                                 "forward's activations and the CUDA graphs' pool are measured "
                                                 "(kv_cache_memory_gb is then ignored). Unset: kv_cache_memory_gb.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _f(128, "Most requests in one step's batch.")
    max_num_batched_tokens: int = _f(2048, "Most tokens (prefill + decode) in one step.")
    enable_chunked_prefill: bool = _f(True, "Split long prompts over several steps to fit the token budget.")
    long_prefill_token_threshold: int = _f(0, "Most tokens of one request's prefill chunk in one step (0: only the "
                                              "token budget caps it); smaller chunks keep the steps that decoding "
                                              "requests wait on short, at the cost of the prompts' TTFT.")


CUDAGraphModeName = Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
FullGraphRule = Literal["strict", "prompt-tail", "decode-shaped"]


@dataclass(frozen=True)
class CompilationConfig:
    cudagraph_mode: CUDAGraphModeName = _f("FULL_AND_PIECEWISE", "Graph policy: FULL decode graphs for eligible "
                                           "batches and/or PIECEWISE (non-attention segments) for the rest.")
    cudagraph_capture_sizes: Optional[str] = _f(None, "Comma-separated token counts to capture (default: 1, 2, 4, "
                                                      "multiples of 8 below 256, then multiples of 16).")
    max_cudagraph_capture_size: Optional[int] = _f(None, "Largest capture size (default: min(2 x max_num_seqs, 512)).")
    enforce_eager: bool = _f(False, "Never use graphs (wins over --cudagraph-mode).")
    full_graph_rule: FullGraphRule = _f("decode-shaped", "Which rows may ride a FULL decode graph: strict (no "
                                        "prefill row, vLLM MRv2 before the fix), prompt-tail (the fix: a one-token "
                                        "prompt tail over prior context on a P/D consumer), decode-shaped (every "
                                        "row q tokens over prior context, any role).")
    cudagraph_metrics: bool = _f(False, "Log a table of graph-mode step counts with the reason for every non-FULL "
                                        "step.")
    cudagraph_metrics_interval: float = _f(10.0, "Seconds between --cudagraph-metrics tables.")

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        if self.cudagraph_capture_sizes:
            try:
                sizes = sorted({int(x) for x in self.cudagraph_capture_sizes.split(",") if x.strip()})
            except ValueError:
                raise ValueError(f"cudagraph_capture_sizes must be comma-separated integers, "
                                 f"got {self.cudagraph_capture_sizes!r}") from None
            if not sizes or sizes[0] < 1:
                raise ValueError("cudagraph_capture_sizes must be positive integers")
            return sizes
        top = self.max_cudagraph_capture_size or min(2 * max_num_seqs, 512)
        ladder = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16))
        return [s for s in ladder if s <= top] or [1]


KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
# Connectors that move prompt KV between a prefill and a decode node. DecodeBenchConnector is the D-side arrival
# driver: it fills the KV of arriving requests with a local prefill pass, standing in for a producer.
PD_CONNECTORS = ("TcpConnector", "NixlConnector", "DecodeBenchConnector")
KNOWN_CONNECTORS = PD_CONNECTORS + ("MultiConnector",)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


INHERITED = ("kv_auth_token", "kv_tls_cert", "kv_tls_key", "kv_tls_ca")  # MultiConnector -> children
_STRINGS = ("kv_connector", "kv_role", "engine_id", "kv_host", "kv_advertise_host", "kv_auth_token", "kv_tls_cert",
            "kv_tls_key", "kv_tls_ca", "kv_load_failure_policy")


def _check_types(d: dict) -> None:
    """JSON types of the fields (nulls already dropped), named on failure: a wrong one would otherwise surface at
    start-up as an AttributeError, or not at all (kv_peers as one string became a tuple of characters: every
    load refused)."""
    for name in _STRINGS:
        if d.get(name) is not None and not isinstance(d[name], str):
            raise ValueError(f"kv_transfer_config.{name} must be a string, got {d[name]!r}")
    peers = d.get("kv_peers", [])
    if not isinstance(peers, (list, tuple)) or not all(isinstance(p, str) and _is_host_port(p) for p in peers):
        raise ValueError(f"kv_transfer_config.kv_peers must be a list of \"host:port\" strings, got {peers!r}")
    nice = d.get("kv_server_nice", 12)
    if isinstance(nice, bool) or not isinstance(nice, int):
        raise ValueError(f"kv_transfer_config.kv_server_nice must be an integer, got {nice!r}")
    if not isinstance(d.get("kv_connector_extra_config", {}), dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
    kids = d.get("connectors", [])
    if not isinstance(kids, (list, tuple)) or not all(isinstance(c, dict) for c in kids):
        raise ValueError("kv_transfer_config.connectors must be a list of connector objects")


def _is_host_port(s: str) -> bool:
    host, sep, port = s.rpartition(":")
    return bool(sep and host.strip("[]") and s == s.strip() and port.isdigit() and 0 < int(port) < 65536)


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config '{json}'`, field names as vLLM's KVTransferConfig where they exist."""
    kv_connector: str
    kv_role: KVRole
    engine_id: str = ""
    kv_host: str = "127.0.0.1"  # producer: bind address of the KV server
    kv_port: int = 14579
    kv_advertise_host: Optional[str] = None  # what P tells D to dial (default: kv_host)
    kv_peers: tuple = ()  # consumer: "host:port" KV endpoints it may dial (default: loopback only)
    kv_auth_token: Optional[str] = None  # default: $PDSERVE_KV_TOKEN; required off loopback
    kv_lease_seconds: float = 30.0
    kv_transfer_timeout: float = 10.0
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # TLS (optional; the HMAC handshake and frame tags run inside it). P serves TLS with kv_tls_cert/kv_tls_key
    # (PEM). D uses TLS when it has kv_tls_ca, or kv_tls_cert (a self-signed pair shared by the deployment: D trusts
    # that cert), and then verifies P's chain and that the cert names the host D dials (kv_advertise_host). With
    # neither, D speaks plain TCP, and a TLS P refuses it (the load fails and D prefills locally).
    kv_tls_cert: Optional[str] = None
    kv_tls_key: Optional[str] = None
    kv_tls_ca: Optional[str] = None
    # Nice value of P's KV server threads: at 12 (CFS weight 70 against the engine's 1024) readers get ~6% of a core
    # that P's engine also wants, and all of an idle one. 0: equal shares (a back-to-back reader halves a busy P's
    # core). The price: while P computes without pause, its reads crawl.
    kv_server_nice: int = 12
    kv_connector_extra_config: dict = field(default_factory=dict)
    connectors: tuple = ()  # children of a MultiConnector

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferConfig":
        if not isinstance(d, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown field(s) {', '.join(unknown)}")
        # null is the default, as an omitted field (configs dumped with every field), where the default is not null
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if v is not None or defaults[k] is None}
        for required in ("kv_connector", "kv_role"):
            if required not in d:
                raise ValueError(f"kv_transfer_config: missing field {required!r}")
        _check_types(d)
        # A MultiConnector's children share the deployment's token and TLS unless they set their own: a token
        # given once (e.g. --kv-auth-token) must never leave a child handshaking with an empty key.
        shared = {k: d[k] for k in INHERITED if d.get(k) is not None}
        d["connectors"] = tuple(cls.from_dict({**shared, **c}) for c in d.get("connectors", ()))
        d["kv_peers"] = tuple(d.get("kv_peers", ()))
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.kv_connector not in KNOWN_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector {self.kv_connector!r} is unknown; "
                             f"known: {', '.join(KNOWN_CONNECTORS)}")
        if self.kv_role not in typing.get_args(KVRole):
            raise ValueError(f"kv_transfer_config.kv_role {self.kv_role!r} is invalid; "
                             f"choose from {', '.join(typing.get_args(KVRole))}")
        if self.kv_connector == "MultiConnector" and not self.connectors:
            raise ValueError("kv_transfer_config.connectors: a MultiConnector needs at least one child")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_transfer_config.kv_load_failure_policy must be 'recompute' or 'fail'")
        if bool(self.kv_tls_cert) != bool(self.kv_tls_key):
            have, need = ("kv_tls_cert", "kv_tls_key") if self.kv_tls_cert else ("kv_tls_key", "kv_tls_cert")
            raise ValueError(f"kv_transfer_config.{need} is required with {have}")
        # what P signs into every request's params: a wrong type here would make D refuse them all (proof.malformed)
        if not isinstance(self.engine_id, str):
            raise ValueError(f"kv_transfer_config.engine_id must be a string, got {self.engine_id!r}")
        for name in ("kv_lease_seconds", "kv_transfer_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"kv_transfer_config.{name} must be a positive number of seconds, got {v!r}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number (0..65535), got {self.kv_port!r}")
        if not 0 <= self.kv_server_nice <= 19:
            raise ValueError("kv_transfer_config.kv_server_nice must be in 0..19")
        for name in ("kv_tls_cert", "kv_tls_key", "kv_tls_ca"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"kv_transfer_config.{name}: no such file {path!r}")
        if self.kv_host not in LOOPBACK and not self.auth_token():
            raise ValueError(f"kv_transfer_config.kv_host {self.kv_host!r} is not loopback: refusing to serve KV "
                             "without kv_auth_token (or PDSERVE_KV_TOKEN)")

    def auth_token(self) -> str:
        return self.kv_auth_token or os.environ.get("PDSERVE_KV_TOKEN", "")

    def tls_server_context(self) -> Optional[ssl.SSLContext]:
        if not self.kv_tls_cert:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.kv_tls_cert, self.kv_tls_key)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"kv_transfer_config.kv_tls_cert/kv_tls_key: cannot load the pair: {e}") from None
        return ctx

    def tls_client_context(self) -> Optional[ssl.SSLContext]:
        ca, name = (self.kv_tls_ca, "kv_tls_ca") if self.kv_tls_ca else (self.kv_tls_cert, "kv_tls_cert")
        if not ca:
            return None
        try:
            return ssl.create_default_context(cafile=ca)  # verifies the chain and the host name
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"kv_transfer_config.{name}: cannot load {ca!r} as trusted certificates: {e}") from None

    @property
    def is_pd_consumer(self) -> bool:
        names = [c.kv_connector for c in self.connectors] if self.kv_connector == "MultiConnector" else [self.kv_connector]
        return self.kv_role == "kv_consumer" and any(n in PD_CONNECTORS for n in names)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    compilation: CompilationConfig = CompilationConfig()
    kv_transfer: Optional[KVTransferConfig] = None
    speculative_config: Optional[SpeculativeConfig] = None

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def is_pd_consumer(self) -> bool:
        return self.kv_transfer is not None and self.kv_transfer.is_pd_consumer

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from flat vLLM-style engine args (dtype=..., block_size=...); unknown names are an error."""
        parts = {}
        kv = kwargs.pop("kv_transfer_config", None)
        if isinstance(kv, str):
            import json
            try:
                kv = json.loads(kv)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
            if kv is None:  # an explicit `null` is a typo more often than a wish for no connector: leave it out
                raise ValueError("kv_transfer_config must be a JSON object (leave it out for no KV connector)")
        if kv is not None and not isinstance(kv, KVTransferConfig):
            kv = KVTransferConfig.from_dict(kv)
        spec = kwargs.pop("speculative_config", None)
        if spec is not None:
            from pdserve.spec_decode.config import SpeculativeConfig
            spec = SpeculativeConfig.from_json(spec) if isinstance(spec, str) else SpeculativeConfig.from_dict(spec)
        for name, sub in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                          ("compilation", CompilationConfig)):
            names = {f.name for f in dataclasses.fields(sub)}
            parts[name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")
        parts["model"] = dataclasses.replace(parts["model"], model=str(model))
        cfg = cls(**parts, kv_transfer=kv, speculative_config=spec)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        c, s = self.cache, self.scheduler
        if self.model.device.startswith("cuda") and _DEVICE.fullmatch(self.model.device):
            _check_cuda(self.model.device)
        checks = [
            (c.block_size >= 1 and c.block_size & (c.block_size - 1) == 0, "block_size must be a power of two"),
            (s.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (s.max_num_batched_tokens >= s.max_num_seqs or s.enable_chunked_prefill,
             "max_num_batched_tokens must be >= max_num_seqs"),
            (s.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (s.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0"),
            (s.long_prefill_token_threshold == 0 or s.enable_chunked_prefill,
             "long_prefill_token_threshold needs enable_chunked_prefill (a capped prompt is computed in chunks)"),
            (0 < c.kv_cache_memory_gb < float("inf"), "kv_cache_memory_gb must be a positive number of GiB"),
            (-2 ** 63 <= self.model.seed < 2 ** 64, "seed must be in [-2**63, 2**64) (torch's generator seeds)"),
            (_DEVICE.fullmatch(self.model.device) is not None,
             f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.model.device!r}"),
            (c.gpu_memory_utilization is None or 0 < c.gpu_memory_utilization <= 1,
             "gpu_memory_utilization must be in (0, 1]"),
            (c.num_gpu_blocks_override is None or c.num_gpu_blocks_override >= 2,
             "num_gpu_blocks_override must be >= 2"),
            (self.model.max_model_len is None or self.model.max_model_len >= 1, "max_model_len must be >= 1"),
            (s.max_num_batched_tokens >= 1 + self.num_speculative_tokens,
             "max_num_batched_tokens must be >= 1 + speculative_config.num_speculative_tokens (a decode row "
             "schedules its last token and all its drafts in one step)"),
            (self.compilation.cudagraph_metrics_interval > 0, "cudagraph_metrics_interval must be > 0"),
            (self.compilation.max_cudagraph_capture_size is None or self.compilation.max_cudagraph_capture_size >= 1,
             "max_cudagraph_capture_size must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, CompilationConfig)
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _check_cuda(device: str) -> None:
    import torch
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else \
            "no CUDA device is visible (or the driver is too old)"
        raise ValueError(f"device {device!r}: {why} (use 'cpu' or 'auto')")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    """Add one `--kebab-name` flag per field of `cls` (fields with metadata cli=False are skipped)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = hints[f.name]
        args = typing.get_args(tp)
        help_text = f.metadata.get("help", "")
        if "default" not in help_text.lower() and "unset" not in help_text.lower():  # a stated default wins
            help_text += f" (default: {f.default})"
        if tp is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
        elif typing.get_origin(tp) is Literal:
            group.add_argument(flag, dest=f.name, choices=args, default=f.default, help=help_text)
        else:
            base = next((a for a in args if a is not type(None)), tp) if args else tp
            if typing.get_origin(base) is Literal:
                group.add_argument(flag, dest=f.name, choices=typing.get_args(base), default=f.default,
                                   help=help_text)
            else:
                group.add_argument(flag, dest=f.name, type=base, default=f.default, help=help_text)


def engine_kwargs_from_args(ns: argparse.Namespace) -> dict:
    names = {f.name for cls in ENGINE_SECTIONS for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
    return {k: v for k, v in vars(ns).items() if k in names}
