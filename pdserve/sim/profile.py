"""Step-time profiles: how long one engine step takes, as a function of its shape and its graph mode.

A profile is a JSON object with a `type`, checked field by field on load (an error names the field, e.g.
`coefficients.per_token_s`); unknown fields are refused, so a typo never silently reads as a default.

- `linear` (fitted by `pdserve sim calibrate` from this machine's engine):
  t = base_s[mode] + per_token_s x padded tokens + per_row_s x rows + per_context_token_s x KV tokens read
- `roofline` (a GPU from its datasheet): t = step_overhead_s[mode] + max(bytes / (bandwidth x memory_efficiency),
  FLOPs / peak), bytes the weights plus the KV read and written, FLOPs the dense layers' per padded token plus
  attention's per (query, key) pair; `gpu.memory_efficiency` (default 1) is the share of the datasheet's bandwidth a
  step's kernels achieve, fitted with the overheads to measured step times (the shipped profiles).

Shipped profiles (pdserve/sim/profiles/*.json) load by their file's stem, e.g. `--profile qwen3-0.6b-b200`.

Both may carry a `fit` object: how the free parameters were found (informational, kept in results), and a
`served` object (`pdserve sim calibrate --served` fits it from a real server's streams): what serving adds to the
bare step and to each request, `step_scale` x step + `step_overhead_s` for a step as a served engine runs it (the
engine loop's wire and records, and on shared cores the server's own work beside it), and `request_latency_s`,
the time a request spends outside the node's steps on each node it visits (HTTP in and out, the request's
translation, the wire to the engine and back), which the simulator adds where the request reaches a node, and
`neighbour_scale` (`--served-neighbours`): on nodes sharing one machine's cores (`pdserve sim --shared-host`), a step
takes (1 + neighbour_scale x k) times as long when k other nodes are mid-step as it starts, and
`chunk_delay_quantiles_s`: how late a streamed chunk reaches the client past its step's end (the host's stalls), as
quantiles at evenly spaced probabilities, drawn per chunk by the simulated client (chunks stay in order), and
`chunk_delay_by_rows` the same per number of streams in flight when measured ({"1": [...], "4": [...]}), which a
chunk from a step of that many rows or more (up to the next) draws from instead; `neighbour_chunk_delay_quantiles_s`
and `neighbour_chunk_delay_by_rows` the same measured beside a busy neighbour (`--served-neighbours`), drawn for
every chunk where several nodes share the host (`pdserve sim --shared-host`).
Both may carry an `idle` section (`pdserve sim calibrate` measures it on the bare engine): what a step costs extra
when the node sat idle before it (its code and working set cool with time on a CPU host, benchmarks/idle_step.py),
`extra_s` at each of `gaps_s` (seconds since the node's last step ended; linear between them and from (0, 0), the
last beyond them), and `decay`: each following step pays that share of the step before it's extra (a gap while one
still decays: the larger of the two).
Both carry a `model` section: `kv_bytes_per_token` (all layers, K and V: what a block of KV costs in memory and on
the wire) and optionally `max_model_len`.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Union

MODES = ("FULL", "PIECEWISE", "NONE")


@dataclass(frozen=True)
class StepShape:
    """What a step costs is read from: its rows as scheduled and the dispatcher's choice."""
    mode: str  # runtime graph mode: FULL, PIECEWISE, NONE
    num_tokens: int  # scheduled tokens (drafts included)
    padded_tokens: int  # tokens the forward runs (a graph's captured size)
    num_reqs: int
    context_tokens: int  # KV tokens attention reads: each row's context plus its own new tokens
    attention_pairs: int  # (query, key) pairs: each new token against its context and the row's earlier new tokens


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Idle:
    """A step's extra seconds after the node sat idle (the module's docstring); none by default."""
    gaps_s: tuple = ()
    extra_s: tuple = ()
    decay: float = 0.0

    def extra(self, gap: float, before: float = 0.0) -> float:
        """The extra of a step that starts `gap` seconds after the node's last step ended, that step having paid
        `before`."""
        carried = before * self.decay
        if gap <= 0 or not self.gaps_s:
            return carried
        g, e = self.gaps_s, self.extra_s
        i = bisect.bisect_left(g, gap)
        if i == len(g):
            cold = e[-1]
        else:
            g0, e0 = (g[i - 1], e[i - 1]) if i else (0.0, 0.0)
            cold = e0 + (gap - g0) / (g[i] - g0) * (e[i] - e0)
        return max(cold, carried)

    @classmethod
    def from_dict(cls, d: dict) -> "Idle":
        if "idle" not in d:
            return cls()
        sec = _section(d, "idle")
        _only(sec, ("gaps_s", "extra_s", "decay"), "idle.")
        gaps, extra = sec.get("gaps_s"), sec.get("extra_s")
        for key, v in (("gaps_s", gaps), ("extra_s", extra)):
            if not isinstance(v, list) or not 1 <= len(v) <= 32:
                raise ProfileError(f"idle.{key}: must be a list of 1 to 32 numbers, got {v!r}"[:160])
        if len(extra) != len(gaps):
            raise ProfileError(f"idle.extra_s: must have one number per idle.gaps_s entry ({len(gaps)}), got "
                               f"{len(extra)}")
        g = tuple(_number({"": v}, "", f"idle.gaps_s[{i}]", positive=True) for i, v in enumerate(gaps))
        if any(b <= a for a, b in zip(g, g[1:])):
            raise ProfileError("idle.gaps_s: must increase")
        e = tuple(_number({"": v}, "", f"idle.extra_s[{i}]") for i, v in enumerate(extra))
        decay = _number(sec, "decay", "idle.")
        if decay >= 1:
            raise ProfileError(f"idle.decay: must be a fraction in [0, 1), got {decay!r}")
        return cls(g, e, decay)


@dataclass(frozen=True)
class ChunkDelays:
    """How late a streamed chunk reaches the client past its step's end (the host's stalls: a process waiting for a
    core): `quantiles` at evenly spaced probabilities 0..1, and `by_rows` the same measured with `rows` streams in
    flight, ((rows, quantiles), ...) by rows ascending; () none."""
    quantiles: tuple = ()
    by_rows: tuple = ()

    def draw(self, u: float, rows: int = 0) -> float:
        """The delay at probability `u` in [0, 1) of a chunk from a step of `rows` rows: the quantiles' inverse CDF,
        linear between them. The quantiles measured at the most streams not above `rows` (the fewest measured below
        them), else the pooled ones: a client reading 16 streams at once lags more than one reading two."""
        q = self.quantiles
        if self.by_rows and rows > 0:
            q = self.by_rows[0][1]
            for r, qr in self.by_rows:
                if r <= rows:
                    q = qr
        if not q:
            return 0.0
        x = u * (len(q) - 1)
        i = min(int(x), len(q) - 2)
        return q[i] + (x - i) * (q[i + 1] - q[i])

    @classmethod
    def from_section(cls, sec: dict, prefix: str) -> "ChunkDelays":
        """From `served.{prefix}chunk_delay_quantiles_s` and `served.{prefix}chunk_delay_by_rows`."""
        return cls(_quantiles(sec.get(f"{prefix}chunk_delay_quantiles_s", []),
                              f"served.{prefix}chunk_delay_quantiles_s"),
                   _by_rows(sec.get(f"{prefix}chunk_delay_by_rows", {}), f"served.{prefix}chunk_delay_by_rows"))


@dataclass(frozen=True)
class Served:
    """What serving adds to a bare step and to each request (the module's docstring); identity by default."""
    step_scale: float = 1.0
    step_overhead_s: float = 0.0
    request_latency_s: float = 0.0
    neighbour_scale: float = 0.0  # per other node mid-step on the same host (--shared-host)
    chunk_delays: ChunkDelays = ChunkDelays()  # served.chunk_delay_*
    # the same measured beside a busy neighbour (`--served-neighbours`, served.neighbour_chunk_delay_*), drawn for
    # every chunk where several nodes share the host (`--shared-host`); none: the lone ones stand in
    neighbour_chunk_delays: ChunkDelays = ChunkDelays()
    # how much later the other rows' chunks of a step that gave a request its first token reach their clients than
    # the step's time says (served.arrival_delay_s: the newcomer's admission between steps, its first output)
    arrival_delay_s: float = 0.0

    def step(self, bare_s: float) -> float:
        return self.step_scale * bare_s + self.step_overhead_s

    def chunk_delay(self, u: float, rows: int = 0, beside: bool = False) -> float:
        """ChunkDelays.draw of the lone delays, or (`beside`: on a host other nodes share) the neighbour ones where
        the profile has them."""
        near = self.neighbour_chunk_delays
        return (near if beside and near.quantiles else self.chunk_delays).draw(u, rows)

    @classmethod
    def from_dict(cls, d: dict) -> "Served":
        if "served" not in d:
            return cls()
        sec = _section(d, "served")
        _only(sec, ("step_scale", "step_overhead_s", "request_latency_s", "neighbour_scale",
                    "chunk_delay_quantiles_s", "chunk_delay_by_rows", "neighbour_chunk_delay_quantiles_s",
                    "neighbour_chunk_delay_by_rows", "arrival_delay_s"), "served.")
        return cls(_number(sec, "step_scale", "served.", positive=True) if "step_scale" in sec else 1.0,
                   *(_number(sec, k, "served.") if k in sec else 0.0
                     for k in ("step_overhead_s", "request_latency_s", "neighbour_scale")),
                   ChunkDelays.from_section(sec, ""), ChunkDelays.from_section(sec, "neighbour_"),
                   _number(sec, "arrival_delay_s", "served.") if "arrival_delay_s" in sec else 0.0)


def _by_rows(by_rows, where: str) -> tuple:
    """{"rows": quantiles, ...} -> ((rows, quantiles), ...) by rows ascending."""
    if not isinstance(by_rows, dict) or len(by_rows) > 64:
        raise ProfileError(f"{where}: must be an object of at most 64 rows -> quantiles, got {by_rows!r}"[:160])
    per_rows = []
    for k, q in by_rows.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) >= 1):
            raise ProfileError(f"{where}.{k}: keys must be row counts >= 1"[:160])
        per_rows.append((int(k), _quantiles(q, f"{where}.{k}")))
    return tuple(sorted(per_rows))


def _quantiles(q, where: str) -> tuple:
    """Delays in seconds at evenly spaced probabilities 0..1: [] (none) or 2 to 101 numbers >= 0, not decreasing."""
    if not isinstance(q, list) or len(q) == 1 or len(q) > 101:
        raise ProfileError(f"{where}: must be a list of 2 to 101 numbers, got {q!r}"[:160])
    delays = tuple(_number({"": v}, "", f"{where}[{i}]") for i, v in enumerate(q))
    if any(b < a for a, b in zip(delays, delays[1:])):
        raise ProfileError(f"{where}: must not decrease (quantiles at evenly spaced probabilities)")
    return delays


def _number(d: dict, key: str, where: str, positive: bool = False) -> float:
    if key not in d:
        raise ProfileError(f"{where}{key}: missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or \
            (positive and v == 0):
        raise ProfileError(f"{where}{key}: must be a number {'> 0' if positive else '>= 0'}, got {v!r}"[:160])
    return float(v)


def _section(d: dict, key: str, where: str = "") -> dict:
    v = d.get(key)
    if not isinstance(v, dict):
        raise ProfileError(f"{where}{key}: " + ("missing" if key not in d else f"must be an object, got {v!r}"[:120]))
    return v


def _only(d: dict, allowed: tuple, where: str) -> None:
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ProfileError(f"{where}{unknown[0]}: unknown field (known: {', '.join(allowed)})")


def _per_mode(d: dict, key: str) -> dict[str, float]:
    sec = _section(d, key)
    _only(sec, MODES, f"{key}.")
    return {m: _number(sec, m, f"{key}.") for m in MODES}


@dataclass(frozen=True)
class ModelShape:
    kv_bytes_per_token: float
    max_model_len: int = 0  # 0: not stated (the sim's --max-model-len, else 4096)

    @classmethod
    def from_dict(cls, d: dict, extra: tuple = ()) -> "ModelShape":
        _only(d, ("kv_bytes_per_token", "max_model_len", "name", *extra), "model.")
        mml = d.get("max_model_len", 0)
        if isinstance(mml, bool) or not isinstance(mml, int) or mml < 0:
            raise ProfileError(f"model.max_model_len: must be an integer >= 1, got {mml!r}"[:120])
        return cls(_number(d, "kv_bytes_per_token", "model.", positive=True), mml)


class _ServedSteps:
    """A profile's step time as served: its type's bare step time through its `served` section."""

    def step_time(self, s: StepShape) -> float:
        return self.served.step(self.bare_step_time(s))


@dataclass(frozen=True)
class LinearProfile(_ServedSteps):
    model: ModelShape
    base_s: dict
    per_token_s: float
    per_row_s: float
    per_context_token_s: float
    raw: dict  # the JSON as loaded (written back unchanged into results)
    served: Served = Served()
    idle: Idle = Idle()

    def bare_step_time(self, s: StepShape) -> float:
        return (self.base_s[s.mode] + self.per_token_s * s.padded_tokens + self.per_row_s * s.num_reqs
                + self.per_context_token_s * s.context_tokens)


@dataclass(frozen=True)
class RooflineProfile(_ServedSteps):
    model: ModelShape
    weight_bytes: float
    flops_per_token: float
    attention_flops_per_pair: float
    bandwidth: float  # bytes/s achieved: the datasheet's times gpu.memory_efficiency
    peak_flops: float  # FLOP/s
    overhead_s: dict
    raw: dict
    served: Served = Served()
    idle: Idle = Idle()

    def bare_step_time(self, s: StepShape) -> float:
        bytes_moved = self.weight_bytes + self.model.kv_bytes_per_token * s.context_tokens
        flops = self.flops_per_token * s.padded_tokens + self.attention_flops_per_pair * s.attention_pairs
        return self.overhead_s[s.mode] + max(bytes_moved / self.bandwidth, flops / self.peak_flops)


Profile = Union[LinearProfile, RooflineProfile]


def profile_from_dict(d: dict) -> Profile:
    if not isinstance(d, dict):
        raise ProfileError(f"a profile is a JSON object, got {type(d).__name__}")
    kind = d.get("type")
    if kind == "linear":
        _only(d, ("type", "name", "device", "model", "coefficients", "fit", "served", "idle"), "")
        c = _section(d, "coefficients")
        _only(c, ("base_s", "per_token_s", "per_row_s", "per_context_token_s"), "coefficients.")
        return LinearProfile(ModelShape.from_dict(_section(d, "model")), _base(c),
                             _number(c, "per_token_s", "coefficients."), _number(c, "per_row_s", "coefficients."),
                             _number(c, "per_context_token_s", "coefficients."), d, Served.from_dict(d),
                             Idle.from_dict(d))
    if kind == "roofline":
        _only(d, ("type", "name", "device", "model", "gpu", "step_overhead_s", "fit", "served", "idle"), "")
        if not isinstance(d.get("fit", {}), dict):
            raise ProfileError(f"fit: must be an object, got {d['fit']!r}"[:120])
        m = _section(d, "model")
        g = _section(d, "gpu")
        _only(g, ("name", "memory_bandwidth_gb_s", "peak_tflops", "memory_efficiency"), "gpu.")
        eff = _fraction(g, "memory_efficiency", "gpu.") if "memory_efficiency" in g else 1.0
        return RooflineProfile(ModelShape.from_dict(m, ("weight_bytes", "flops_per_token", "attention_flops_per_pair")),
                               _number(m, "weight_bytes", "model.", positive=True),
                               _number(m, "flops_per_token", "model.", positive=True),
                               _number(m, "attention_flops_per_pair", "model.") if "attention_flops_per_pair" in m
                               else 0.0,
                               _number(g, "memory_bandwidth_gb_s", "gpu.", positive=True) * 1e9 * eff,
                               _number(g, "peak_tflops", "gpu.", positive=True) * 1e12,
                               _per_mode(d, "step_overhead_s"), d, Served.from_dict(d), Idle.from_dict(d))
    raise ProfileError(f"type: must be 'linear' or 'roofline', got {kind!r}"[:120] if "type" in d else "type: missing")


def _fraction(d: dict, key: str, where: str) -> float:
    v = _number(d, key, where, positive=True)
    if v > 1:
        raise ProfileError(f"{where}{key}: must be a fraction in (0, 1], got {v!r}")
    return v


def _base(c: dict) -> dict[str, float]:
    sec = _section(c, "base_s", "coefficients.")
    _only(sec, MODES, "coefficients.base_s.")
    return {m: _number(sec, m, "coefficients.base_s.") for m in MODES}


SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"


def shipped_profiles() -> list[str]:
    """The names of the profiles shipped with pdserve (pdserve/sim/profiles/NAME.json)."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))


def load_profile(path: Union[str, Path]) -> Profile:
    """The profile in `path`, or the shipped profile of that name (a bare name with no such file here); ProfileError
    (a ValueError) naming the file and the bad field."""
    # a path wins over a shipped name, so a local copy named like a shipped profile is the one read
    if isinstance(path, str) and "/" not in path and not path.endswith(".json") and not Path(path).exists():
        if (SHIPPED_DIR / f"{path}.json").is_file():
            path = SHIPPED_DIR / f"{path}.json"
        else:
            raise ProfileError(f"--profile {path}: no such file, nor a shipped profile (shipped: "
                               f"{', '.join(shipped_profiles()) or 'none'})")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"--profile {path}: {e.strerror or e}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"--profile {path}: not JSON ({e})") from None
    try:
        return profile_from_dict(d)
    except ProfileError as e:
        raise ProfileError(f"--profile {path}: {e}") from None
