"""Workloads for the serving engine: OpenHands-style agent sessions, agentic trace replay, and a
closed-loop client that keeps a fixed number of sessions in flight.

Two kinds of session (`Session.mode`):

- "append" (a live conversation): turn k's prompt is everything the session has seen so far (earlier
  prompts and the tokens the engine actually generated) followed by `Turn.input_tokens` new tokens.
  `openhands_sessions` builds these: 13 turns, first turn 74,160 tokens, later turns 753 new tokens,
  220 output tokens per turn (BRIEF §8), every length times `scale` (at least 1 token).
- "trace" (replay): turn k's prompt is exactly `Turn.input_tokens` tokens made from `Turn.hash_ids`,
  one id per 64-token block (the last block may be partial). Equal ids mean equal tokens, so prefix
  reuse in the trace becomes prefix reuse in the engine; generated tokens are not fed back (the trace
  says what the next prompt is). `synthetic_trace` generates such sessions shaped like the published
  agentic-coding traces; `load_trace` / `save_trace` read and write the JSON format below.

Trace JSON (format "glm53-agentic-trace/1"):

    {"format": "glm53-agentic-trace/1", "block_tokens": 64,
     "sessions": [{"id": "s0", "user": "u0", "parent": null, "branch_after_turn": null,
                   "turns": [{"input_tokens": 9000, "output_tokens": 400, "think_s": 2.5,
                              "hash_ids": [0, 1, ..., 140]}, ...]}, ...]}

Other formats users have are read into the same sessions (`read_trace` detects which;
`workload.kind="trace"` takes any of them): Mooncake / aiperf `mooncake_trace` JSONL with 512-token hash
ids (`load_mooncake_trace`), and the Weka / SemiAnalysis agentic-coding traces with 64-token hash ids and
subagents (`load_weka_traces`). A hash id of a larger block becomes the ids of its 64-token sub-blocks.

`parent` / `branch_after_turn` make a subagent branch: the session may start once its parent has
finished that turn (its prompts normally begin with the parent's blocks, so it hits the parent's prefix).
Users are isolated by a per-user salt (`ClosedLoopClient(salt_prefix=...)` -> salt `prefix + user`):
two users with the same hash ids share nothing in the prefix cache.

`ClosedLoopClient` drives anything with the Engine's add_request / step / has_unfinished / clock
interface, so a simulator can replay the same workload in virtual time. This module does not import JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

TRACE_FORMAT = "glm53-agentic-trace/1"
TRACE_BLOCK_TOKENS = 64
MODES = ("append", "trace")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request of a session. input_tokens: new tokens ("append") or the whole prompt ("trace");
    think_s: the user's delay after the previous turn finished before sending this one (seconds)."""

    input_tokens: int
    output_tokens: int
    think_s: float = 0.0
    hash_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.input_tokens < 1 or self.output_tokens < 1 or self.think_s < 0:
            raise ValueError(f"a turn needs input_tokens >= 1, output_tokens >= 1, think_s >= 0; got {self}")


@dataclasses.dataclass(frozen=True)
class Session:
    session_id: str
    user: str
    turns: tuple[Turn, ...]
    mode: str = "append"
    parent: str | None = None
    branch_after_turn: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Session.mode must be one of {MODES}, got {self.mode!r}")
        if not self.turns:
            raise ValueError(f"session {self.session_id!r} has no turns")
        if (self.parent is None) != (self.branch_after_turn is None):
            raise ValueError(f"session {self.session_id!r}: parent and branch_after_turn go together")
        if self.parent is not None and self.mode != "trace":
            raise ValueError(f"session {self.session_id!r}: subagent branches are trace sessions (their prompts "
                             "name the parent's blocks)")
        if self.mode == "trace":
            for k, t in enumerate(self.turns):
                if len(t.hash_ids) != math.ceil(t.input_tokens / TRACE_BLOCK_TOKENS):
                    raise ValueError(f"session {self.session_id!r} turn {k}: {t.input_tokens} input tokens need "
                                     f"{math.ceil(t.input_tokens / TRACE_BLOCK_TOKENS)} hash ids, got {len(t.hash_ids)}")

    def max_context_tokens(self) -> int:
        """The most tokens one of its requests holds (prompt + output): what max_model_len must admit."""
        if self.mode == "trace":
            return max(t.input_tokens + t.output_tokens for t in self.turns)
        return sum(t.input_tokens + t.output_tokens for t in self.turns)


def _scaled(n: float, scale: float) -> int:
    return max(1, round(n * scale))


def openhands_sessions(num_sessions: int, *, scale: float = 1.0, turns: int = 13, first_input: int = 74_160,
                       later_input: int = 753, output: int = 220, think_s: float = 0.0) -> list[Session]:
    """OpenHands-style multi-turn agent sessions (BRIEF §8), every length times `scale`; one user each."""
    if num_sessions < 1 or turns < 1 or scale <= 0:
        raise ValueError("num_sessions and turns must be >= 1 and scale > 0")
    ts = tuple(Turn(_scaled(first_input if k == 0 else later_input, scale), _scaled(output, scale),
                    0.0 if k == 0 else think_s) for k in range(turns))
    return [Session(f"oh{i}", f"user{i}", ts) for i in range(num_sessions)]


def synthetic_trace(num_sessions: int, *, seed: int = 0, scale: float = 1.0, median_turns: float = 43,
                    mean_input: float = 142_000, mean_output: float = 444, first_input_frac: float = 0.2,
                    think_mean_s: float = 3.0, subagent_prob: float = 0.02, max_turns: int = 200,
                    max_context: int | None = None) -> list[Session]:
    """Agentic-coding sessions shaped like the published traces: turns per session lognormal with median
    `median_turns`; prompts that grow linearly from `first_input_frac * 2 * mean_input / (1 + frac)` so
    their mean over a session is about `mean_input`; outputs lognormal with mean `mean_output`; each turn
    re-sends the previous prompt's full blocks (so prefix reuse is 1 - growth / prompt, > 95% at the
    defaults) plus new blocks for the previous output and the new input. With probability
    `subagent_prob` per turn a subagent branch (a short session of the same user that starts from the
    parent's current prompt) is spawned. Lengths are multiplied by `scale` (at least 1 token).
    max_context: a session (or subagent) ends before a turn whose prompt + output would exceed it, as an
    agent whose context is full stops (compaction is not modelled); a first turn over it is cut to fit."""
    rng = np.random.default_rng(seed)
    next_id = iter(range(1 << 62))
    sessions: list[Session] = []

    def blocks_for(prev_ids: tuple[int, ...], prev_len: int, new_len: int) -> tuple[int, ...]:
        keep = prev_ids[: min(prev_len, new_len) // TRACE_BLOCK_TOKENS]  # a partial block's content changes
        return keep + tuple(next(next_id) for _ in range(math.ceil(new_len / TRACE_BLOCK_TOKENS) - len(keep)))

    first = 2 * mean_input * first_input_frac / (1 + first_input_frac)

    def make(sid: str, user: str, n_turns: int, growth: float, start_ids: tuple[int, ...] = (), start_len: int = 0,
             parent: str | None = None, branch: int | None = None) -> None:
        turns, children, ids, length = [], [], start_ids, start_len
        for k in range(n_turns):
            target = _scaled(first + k * growth if parent is None else start_len / scale + (k + 1) * growth, scale)
            target = max(target, length + 1)
            out = _scaled(rng.lognormal(math.log(mean_output) - 0.5 * 0.6**2, 0.6), scale)
            if max_context is not None and target + out > max_context:
                if turns or length >= max_context - 1:
                    break
                out = max(1, min(out, max_context // 2))
                target = max_context - out
            ids = blocks_for(ids, length, target)
            think = 0.0 if k == 0 else float(rng.exponential(think_mean_s))
            turns.append(Turn(target, out, think, ids))
            length = target
            if parent is None and rng.random() < subagent_prob:
                children.append((f"{sid}.sub{k}", int(rng.integers(2, 8)), ids, length, k))
        if not turns:  # a subagent that starts at the context limit never runs
            return
        sessions.append(Session(sid, user, tuple(turns), "trace", parent, branch))
        for cid, n, cids, clen, k in children:  # after the parent, so a trace lists parents first
            make(cid, user, n, growth, cids, clen, parent=sid, branch=k)

    for i in range(num_sessions):
        n = int(np.clip(round(rng.lognormal(math.log(median_turns), 0.5)), 1, max_turns))
        make(f"s{i}", f"user{i}", n, 2 * (mean_input - first) / max(n - 1, 1))
    return sessions


def trace_stats(sessions: Sequence[Session]) -> dict:
    """Shape of a trace: turns per session, input / output tokens per request, and prefix reuse (the
    share of prompt blocks an earlier request of the same user already sent)."""
    seen: dict[str, set[int]] = {}
    reused = total = 0
    for s in sessions:  # parents come before their branches (synthetic_trace's order)
        user_seen = seen.setdefault(s.user, set())
        for t in s.turns:
            reused += sum(h in user_seen for h in t.hash_ids[: t.input_tokens // TRACE_BLOCK_TOKENS])
            total += math.ceil(t.input_tokens / TRACE_BLOCK_TOKENS)
            user_seen.update(t.hash_ids)
    top = [s for s in sessions if s.parent is None]
    turns = [t for s in sessions for t in s.turns]
    return {
        "sessions": len(top),
        "subagent_sessions": len(sessions) - len(top),
        "turns_median": float(np.median([len(s.turns) for s in top])),
        "input_tokens_mean": float(np.mean([t.input_tokens for t in turns])),
        "output_tokens_mean": float(np.mean([t.output_tokens for t in turns])),
        "prefix_reuse": reused / total if total else 0.0,
    }


def save_trace(sessions: Sequence[Session], path: str | Path) -> None:
    if any(s.mode != "trace" for s in sessions):
        raise ValueError("only trace-mode sessions (prompts given by hash ids) can be saved as a trace")
    doc = {"format": TRACE_FORMAT, "block_tokens": TRACE_BLOCK_TOKENS, "sessions": [
        {"id": s.session_id, "user": s.user, "parent": s.parent, "branch_after_turn": s.branch_after_turn,
         "turns": [{"input_tokens": t.input_tokens, "output_tokens": t.output_tokens, "think_s": t.think_s,
                    "hash_ids": list(t.hash_ids)} for t in s.turns]} for s in sessions]}
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # never leave half a trace behind


def load_trace(path: str | Path) -> list[Session]:
    """Read a trace file; malformed files fail with the field and session named."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: expected format {TRACE_FORMAT!r}, got {doc.get('format') if isinstance(doc, dict) else doc!r}")
    if doc.get("block_tokens") != TRACE_BLOCK_TOKENS:
        raise ValueError(f"{path}: block_tokens must be {TRACE_BLOCK_TOKENS}, got {doc.get('block_tokens')!r}")
    out, ids = [], set()
    for i, s in enumerate(doc.get("sessions", [])):
        try:
            turns = tuple(Turn(int(t["input_tokens"]), int(t["output_tokens"]), float(t.get("think_s", 0.0)),
                               tuple(int(h) for h in t["hash_ids"])) for t in s["turns"])
            sess = Session(str(s["id"]), str(s["user"]), turns, "trace", s.get("parent"), s.get("branch_after_turn"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: session #{i}: {e!r}") from None
        if sess.parent is not None and sess.parent not in ids:
            raise ValueError(f"{path}: session {sess.session_id!r} branches from {sess.parent!r}, which does not "
                             "come before it")
        ids.add(sess.session_id)
        out.append(sess)
    return out


# ------------------------------------------------------------------------------ other trace formats
MOONCAKE_BLOCK_TOKENS = 512  # the block size of Mooncake's hash ids (FAST'25 traces; aiperf's default)
TRACE_FORMATS = ("auto", "glm53", "mooncake", "weka")


def _sub_blocks(hash_ids, block: int, input_tokens: int, where: str) -> tuple[int, ...]:
    """Hash ids of `block`-token blocks -> the ids of the 64-token blocks a prompt of `input_tokens` holds:
    block id h stands for sub-blocks h x (block / 64) + j, so prompts that share a large block share
    all of its sub-blocks and nothing else. The ids must cover the prompt exactly (ceil(input / block))."""
    if block < TRACE_BLOCK_TOKENS or block % TRACE_BLOCK_TOKENS:
        raise ValueError(f"{where}: block size {block} is not a multiple of {TRACE_BLOCK_TOKENS} tokens")
    ids = [int(h) for h in hash_ids]
    need = math.ceil(input_tokens / block)
    if len(ids) != need or any(h < 0 for h in ids):
        raise ValueError(f"{where}: {input_tokens} input tokens need {need} non-negative hash ids of {block}-token "
                         f"blocks, got {len(ids)}")
    per = block // TRACE_BLOCK_TOKENS
    return tuple(h * per + j for h in ids for j in range(per))[: math.ceil(input_tokens / TRACE_BLOCK_TOKENS)]


def load_mooncake_trace(path: str | Path, *, block: int = MOONCAKE_BLOCK_TOKENS) -> list[Session]:
    """A Mooncake / aiperf `mooncake_trace` JSONL file: one request per line, `{"timestamp" (ms),
    "input_length", "output_length", "hash_ids" (optional, `block`-token blocks), "session_id" and
    "delay" (ms, optional: aiperf's multi-turn form)}`. Lines with a session_id become the turns of one
    session in file order (think time = delay); other lines are one-turn sessions. The hash ids are one
    namespace for the whole file (Mooncake's cross-request prefix sharing), so every session has one
    user. A line without hash_ids gets ids no other line uses. Timestamps are not replayed: the client
    is closed-loop (a fixed number of sessions in flight). Lines carrying prompt text (`messages`,
    `text_input`, `payload`) are refused: this replay makes tokens from hash ids."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: a request must be a JSON object")
        text = [k for k in ("messages", "text_input", "payload") if k in rec]
        if text:
            raise ValueError(f"{path}:{n}: carries prompt text ({', '.join(text)}); this replay needs input_length "
                             "and hash_ids")
        records.append((n, rec))
    if not records:
        raise ValueError(f"{path}: no requests")
    try:
        fresh = 1 + max((int(h) for _, r in records for h in r.get("hash_ids") or ()), default=-1)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: hash_ids must be lists of integers ({e})") from None
    turns: dict[str, list[Turn]] = {}
    for n, rec in records:
        where = f"{path}:{n}"
        try:
            inp, out = int(rec["input_length"]), int(rec["output_length"])
            ids = rec.get("hash_ids")
            if ids is None:  # a prompt of its own
                ids = list(range(fresh, fresh + math.ceil(inp / block)))
                fresh += len(ids)
            sid = str(rec["session_id"]) if rec.get("session_id") is not None else f"mc{n}"
            own = turns.setdefault(sid, [])
            think = float(rec.get("delay", 0)) / 1000 if own else 0.0
            own.append(Turn(inp, out, think, _sub_blocks(ids, block, inp, where)))
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    return [Session(sid, "mooncake", tuple(ts), "trace") for sid, ts in turns.items()]


def _weka_rows(path: Path) -> list[tuple[str, dict]]:
    """(where, trace object) of a Weka / SemiAnalysis agentic-coding trace file (one object, or a list of
    them), a JSONL file of them (a dataset's rows), or a directory of such files (sorted by name)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
        if not files:
            raise ValueError(f"{path}: no .json or .jsonl trace files")
        return [row for f in files for row in _weka_rows(f)]
    text = path.read_text()
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    docs.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        return docs
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return [(f"{path}[{i}]", d) for i, d in enumerate(doc)] if isinstance(doc, list) else [(str(path), doc)]


def load_weka_traces(path: str | Path) -> list[Session]:
    """Agentic-coding traces in the Weka KV-cache-tester form SemiAnalysis publishes (64-token hash ids
    with subagents): per trace `{"id", "block_size", "hash_id_scope": "local" | "global", "requests":
    [...]}`, each request `{"type": "n" | "s", "t" (s), "in", "out", "hash_ids", "think_time" / "api_time"
    (s, optional)}` or a subagent marker `{"type": "subagent", "agent_id", "requests": [...]}` (nested
    markers allowed). A trace becomes a session, a subagent a session of the same user branching after
    the parent's last request before the marker (`parent`, `branch_after_turn`; one that comes before
    any request of its parent branches where its parent does, or starts on its own). Think time: the
    request's think_time, else its start minus the end (t + api_time) of the session's previous request.
    Scope "local" (one hash namespace per trace): one user per trace, so salts keep traces apart;
    "global": one user for all traces, which share blocks. What is not kept: the parent waiting for a
    subagent to finish (our trace format has branch points only) and the recorded timestamps (the client
    is closed-loop)."""
    out: list[Session] = []
    ids: set[str] = set()

    def flatten(where: str, sid: str, user: str, block: int, requests, parent, branch) -> None:
        if not isinstance(requests, list) or not requests:
            raise ValueError(f"{where}: 'requests' must be a non-empty list")
        turns: list[Turn] = []
        children = []
        end = None
        for k, r in enumerate(requests):
            at = f"{where} request #{k}"
            kind = r.get("type") if isinstance(r, dict) else None
            try:
                if kind in ("n", "s"):
                    t = float(r["t"])
                    think = r.get("think_time")
                    think = float(think) if think is not None else (max(0.0, t - end) if end is not None else 0.0)
                    end = t + float(r.get("api_time") or 0.0)
                    inp = int(r["in"])
                    turns.append(Turn(inp, int(r["out"]), think if turns else 0.0,
                                      _sub_blocks(r.get("hash_ids", ()), block, inp, at)))
                elif kind == "subagent":
                    children.append((r, len(turns) - 1, at))
                else:
                    raise ValueError(f"unknown request type {kind!r} (expected 'n', 's' or 'subagent')")
            except KeyError as e:
                raise ValueError(f"{at}: missing field {e}") from None
            except (TypeError, ValueError) as e:
                raise ValueError(f"{at}: {e}") from None
        if sid in ids:
            raise ValueError(f"{where}: session id {sid!r} appears twice")
        if turns:
            ids.add(sid)
            out.append(Session(sid, user, tuple(turns), "trace", parent, branch))
        for r, k, at in children:
            cid = f"{sid}/{r.get('agent_id', len(out))}"
            # a marker before any request of this session branches where this session does
            here = (sid, k) if turns and k >= 0 else (parent, branch)
            flatten(at, cid, user, block, r.get("requests"), *here)

    for where, doc in _weka_rows(Path(path)):
        if not isinstance(doc, dict) or "requests" not in doc or "id" not in doc:
            raise ValueError(f"{where}: not a trace object (needs 'id' and 'requests')")
        scope = doc.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise ValueError(f"{where}: hash_id_scope must be 'local' or 'global', got {scope!r}")
        try:
            block = int(doc.get("block_size", TRACE_BLOCK_TOKENS))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: block_size must be an integer, got {doc.get('block_size')!r}") from None
        sid = str(doc["id"])
        flatten(where, sid, sid if scope == "local" else "global", block, doc["requests"], None, None)
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def detect_trace_format(path: str | Path) -> str:
    """"glm53" (our JSON: a "format" key), "weka" (a directory, or JSON / JSONL of objects with
    "requests"), or "mooncake" (JSONL of requests with "input_length"); ValueError otherwise."""
    path = Path(path)
    if path.is_dir():
        return "weka"
    text = path.read_text()
    try:  # one JSON document: ours, a Weka trace or a list of them (or a one-line JSONL file)
        doc = json.loads(text)
    except json.JSONDecodeError:  # JSONL: judge by its first record
        try:
            doc = json.loads(next((ln for ln in text.splitlines() if ln.strip()), "null"))
        except json.JSONDecodeError:
            doc = None
    if isinstance(doc, list) or isinstance(doc, dict) and "requests" in doc:
        return "weka"
    if isinstance(doc, dict) and "format" in doc:
        return "glm53"
    if isinstance(doc, dict) and "input_length" in doc:
        return "mooncake"
    raise ValueError(f"{path}: not a trace this project reads (formats: {', '.join(TRACE_FORMATS[1:])})")


def read_trace(path: str | Path, fmt: str = "auto") -> list[Session]:
    """Sessions of a trace file in any format this module reads (`TRACE_FORMATS`; "auto": detected)."""
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"trace format must be one of {TRACE_FORMATS}, got {fmt!r}")
    fmt = detect_trace_format(path) if fmt == "auto" else fmt
    return {"glm53": load_trace, "mooncake": load_mooncake_trace, "weka": load_weka_traces}[fmt](path)


@functools.lru_cache(maxsize=1 << 16)
def block_tokens(hash_id: int, vocab_size: int) -> np.ndarray:
    """The 64 tokens a trace block id stands for (the same for every user: salts separate users).
    Cached and shared: do not modify the returned array."""
    return np.random.default_rng([hash_id, 0x9E3779B9]).integers(0, vocab_size, TRACE_BLOCK_TOKENS, dtype=np.int32)


@dataclasses.dataclass
class _Live:
    session: Session
    turn: int = 0
    context: np.ndarray | None = None  # append mode: every token so far
    # trace mode: the hash ids of the last prompt built and all their blocks' tokens (read-only), which the
    # next turn's prompt starts with wherever its ids do
    blocks: tuple[np.ndarray, np.ndarray] | None = None
    ready_s: float = 0.0
    in_flight: str | None = None


@dataclasses.dataclass
class ClientResult:
    request_ids: list[str]  # every request the client sent, in order
    sessions_done: int
    steps: int  # engine steps the client ran (a step may only move KV; the final drain is not counted)
    # (start, end) on the engine clock. By default from the run's start to the first time a slot of the
    # pool fell free with no session to take it (none left, or only subagents whose parents have not
    # reached their branch point); from then on fewer than `concurrency` sessions run. With run()'s
    # warmup_s / window_s: (start + warmup_s, start + warmup_s + window_s), all of it saturated. None when
    # the first fill already fell short (no more eligible sessions than concurrency): no steady part.
    steady_window: tuple[float, float] | None = None
    sessions_started: int = 0  # sessions that sent at least one request


class ClosedLoopClient:
    """Keep `concurrency` sessions in flight: when one finishes its last turn the next waiting session
    (subagent branches once their parent reached the branch point) takes its place. A session sends a
    turn `think_s * think_time_scale` seconds after its previous turn finished, on the engine's clock.

    engine: add_request(prompt, SamplingParams, salt=) -> req_id; step() -> [(req_id, token, finished)];
    has_unfinished(); clock.now() and clock.sleep(s).
    make_params(max_new_tokens) -> the SamplingParams of a turn (greedy by default, supplied by the caller
    so this module stays free of the engine's imports).
    """

    def __init__(self, engine, sessions: Sequence[Session], concurrency: int, *, vocab_size: int,
                 make_params: Callable[[int], object], seed: int = 0, think_time_scale: float = 1.0,
                 salt_prefix: str = "", max_model_len: int | None = None):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        ids = [s.session_id for s in sessions]
        if len(set(ids)) != len(ids):
            raise ValueError("session ids must be unique")
        if max_model_len is not None:
            for s in sessions:
                if s.max_context_tokens() > max_model_len:
                    raise ValueError(f"session {s.session_id!r} reaches {s.max_context_tokens()} tokens > "
                                     f"max_model_len={max_model_len}: raise max_model_len or shrink the workload")
        self.engine = engine
        self.sessions = list(sessions)
        self.concurrency = concurrency
        self.vocab_size = vocab_size
        self.make_params = make_params
        self.rng = np.random.default_rng(seed)
        self.think_time_scale = think_time_scale
        self.salt_prefix = salt_prefix
        self.done_turns: dict[str, int] = {}  # session -> turns finished

    def _eligible(self, s: Session) -> bool:
        return s.parent is None or self.done_turns.get(s.parent, 0) > s.branch_after_turn

    def _prompt(self, live: _Live) -> np.ndarray:
        t = live.session.turns[live.turn]
        if live.session.mode == "trace":
            # the blocks the last turn's prompt shares with this one are taken from it, not rebuilt: a
            # session's turns extend one another, and a block's tokens cost a generator each (the same
            # tokens either way)
            ids = np.asarray(t.hash_ids, np.int64)
            shared, parts = 0, []
            if live.blocks is not None:
                prev_ids, prev = live.blocks
                m = min(ids.size, prev_ids.size)
                same = ids[:m] == prev_ids[:m]
                shared = m if same.all() else int(np.argmin(same))  # the leading ids the two prompts share
                parts.append(prev[: shared * TRACE_BLOCK_TOKENS])
            parts += [block_tokens(int(h), self.vocab_size) for h in ids[shared:]]
            toks = np.concatenate(parts) if parts else np.zeros(0, np.int32)
            toks.setflags(write=False)
            live.blocks = (ids, toks)
            return toks[: t.input_tokens]
        new = self.rng.integers(0, self.vocab_size, t.input_tokens, dtype=np.int32)
        return new if live.context is None else np.concatenate([live.context, new])

    def run(self, on_step: Callable[[object], None] | None = None, stop_at_drain: bool = False,
            warmup_s: float = 0.0, window_s: float = 0.0) -> ClientResult:
        """Run every session to its end. on_step(engine) is called after each engine step.

        stop_at_drain: at the end of `ClientResult.steady_window` (the pool first ran short), stop once
        every request in flight then has finished, instead of running the drain, in which fewer and
        fewer sessions are left (with heavy-tailed session lengths and subagents waiting on their parents
        it can be most of a run; docs/simulator.md "Part 2"). Requests sent after the window may be
        unfinished: the engine is the caller's to shut down.
        warmup_s, window_s (simulated seconds, need stop_at_drain): the window starts warmup_s after the
        run's start (its first requests all arrive at once, with cold caches) and, with window_s > 0,
        lasts window_s: the run stops there as at the drain. The pool must stay full over all of it
        (ValueError naming the time it ran short otherwise: serve more sessions)."""
        if (warmup_s or window_s) and not stop_at_drain:
            raise ValueError("warmup_s / window_s measure a steady window: they need stop_at_drain=True")
        if warmup_s < 0 or window_s < 0:
            raise ValueError(f"warmup_s and window_s must be >= 0, got {warmup_s}, {window_s}")
        eng, clock = self.engine, self.engine.clock
        self.done_turns = {}
        pending = list(self.sessions)
        active: list[_Live] = []
        by_req: dict[str, _Live] = {}
        sent: list[str] = []
        steps = done = 0
        start = clock.now()
        begin, end = start + warmup_s, start + warmup_s + window_s if window_s else None
        window, before_end = None, set()  # requests in flight when the window ended
        filled = False  # the first fill is done
        started = 0

        def short() -> tuple[float, float]:  # the pool ran short now: the window up to here
            if (warmup_s or window_s) and clock.now() < (begin if end is None else end):
                raise ValueError(f"the pool of {self.concurrency} ran short of sessions at "
                                 f"t={clock.now() - start:.1f} s, before the end of the warm-up ({warmup_s:g} s) "
                                 f"and window ({window_s:g} s): serve more sessions")
            return begin, clock.now()

        while pending or active:
            while len(active) < self.concurrency:
                nxt = next((s for s in pending if self._eligible(s)), None)
                if nxt is None:
                    break
                pending.remove(nxt)
                active.append(_Live(nxt, ready_s=clock.now()))
            if not filled:
                filled = True
                saturated = len(active) == self.concurrency
                if not saturated and stop_at_drain:
                    raise ValueError(f"stop_at_drain: {len(active)} eligible sessions at concurrency "
                                     f"{self.concurrency}: no steady part; run more sessions than concurrency")
            elif end is not None and window is None and clock.now() >= end:
                window, before_end = (begin, end), set(by_req)
            elif saturated and window is None and len(active) < self.concurrency:
                window, before_end = short(), set(by_req)
            if stop_at_drain and window is not None and before_end.isdisjoint(by_req):
                return ClientResult(sent, done, steps, window, started)
            now = clock.now()
            for live in active:
                if live.in_flight is None and live.ready_s <= now:
                    t = live.session.turns[live.turn]
                    prompt = self._prompt(live)
                    rid = eng.add_request(prompt, self.make_params(t.output_tokens),
                                          salt=self.salt_prefix + live.session.user if self.salt_prefix else "")
                    if live.session.mode == "append":
                        live.context = prompt
                    live.in_flight = rid
                    by_req[rid] = live
                    sent.append(rid)
                    started += live.turn == 0
            if not eng.has_unfinished():
                waits = [lv.ready_s for lv in active if lv.in_flight is None]
                if not waits:
                    if any(lv.in_flight is not None for lv in active):
                        raise RuntimeError("the engine went idle with requests in flight: "
                                           f"{[lv.in_flight for lv in active if lv.in_flight is not None]}")
                    if pending and not active:
                        raise RuntimeError(f"sessions {[s.session_id for s in pending]} wait for parents that never "
                                           "reach their branch point")
                    continue
                clock.sleep(max(0.0, min(waits) - clock.now()))
                continue
            for rid, tok, fin in eng.step():
                live = by_req.get(rid)
                if live is None:
                    continue
                if live.session.mode == "append":
                    live.context = np.append(live.context, np.int32(tok))
                if fin:
                    del by_req[rid]
                    live.in_flight = None
                    live.turn += 1
                    self.done_turns[live.session.session_id] = live.turn
                    if live.turn == len(live.session.turns):
                        active.remove(live)
                        done += 1
                    else:
                        live.ready_s = clock.now() + live.session.turns[live.turn].think_s * self.think_time_scale
            steps += 1
            if on_step is not None:
                on_step(eng)
        if window is None and filled and saturated:  # every slot was busy until the last sessions ended together
            window = short()
        while eng.has_unfinished():  # no request left: the last KV transfers (parking the last turns) run
            eng.step()
        return ClientResult(sent, done, steps, window, started)
