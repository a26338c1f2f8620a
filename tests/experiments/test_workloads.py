"""Workloads: OpenHands session shapes, the synthetic agentic trace's statistics, the trace file format,
and the closed-loop client (against a fake engine on a virtual clock: no model needed)."""

import json

import numpy as np
import pytest

from experiments import workloads as wl
from experiments.common import REPO, load_config


def test_openhands_lengths_scale():
    full = wl.openhands_sessions(1)[0]
    assert [t.input_tokens for t in full.turns] == [74_160] + [753] * 12
    assert {t.output_tokens for t in full.turns} == {220}
    s16 = wl.openhands_sessions(3, scale=1 / 16)
    assert (s16[0].turns[0].input_tokens, s16[0].turns[1].input_tokens, s16[0].turns[0].output_tokens) == (4635, 47, 14)
    assert len({s.user for s in s16}) == 3
    assert s16[0].max_context_tokens() == 4635 + 12 * 47 + 13 * 14


def test_synthetic_sessions_end_at_the_context_limit():
    """max_context: a session (and a subagent, which starts from its parent's prompt) stops before a turn
    that would not fit, so a deployment with that max_model_len admits every request of the trace."""
    free, capped = wl.synthetic_trace(60, seed=3), wl.synthetic_trace(60, seed=3, max_context=60_000)
    assert max(s.max_context_tokens() for s in free) > 60_000  # the cap binds
    assert max(s.max_context_tokens() for s in capped) <= 60_000
    assert all(s.turns for s in capped)
    assert sum(len(s.turns) for s in capped) < sum(len(s.turns) for s in free)  # long sessions end early


def test_synthetic_trace_matches_published_shape():
    sessions = wl.synthetic_trace(200, seed=3)
    st = wl.trace_stats(sessions)
    assert 38 <= st["turns_median"] <= 48
    assert st["input_tokens_mean"] == pytest.approx(142_000, rel=0.15)
    assert st["output_tokens_mean"] == pytest.approx(444, rel=0.15)
    assert st["prefix_reuse"] > 0.95
    assert st["subagent_sessions"] > 0
    seen = set()
    for s in sessions:  # parents first, and a branch starts from its parent's blocks at the branch turn
        if s.parent is not None:
            assert s.parent in seen
            parent = next(p for p in sessions if p.session_id == s.parent)
            base = parent.turns[s.branch_after_turn]
            full = base.input_tokens // wl.TRACE_BLOCK_TOKENS
            assert s.turns[0].hash_ids[:full] == base.hash_ids[:full]
        seen.add(s.session_id)
    # every later turn re-sends the earlier turn's full blocks
    s = sessions[0]
    for a, b in zip(s.turns, s.turns[1:]):
        k = a.input_tokens // wl.TRACE_BLOCK_TOKENS
        assert b.hash_ids[:k] == a.hash_ids[:k] and b.input_tokens > a.input_tokens


def test_trace_file_round_trip_and_bad_files(tmp_path):
    sessions = wl.synthetic_trace(3, seed=1, scale=1 / 64)
    path = tmp_path / "trace.json"
    wl.save_trace(sessions, path)
    assert wl.load_trace(path) == sessions
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind
    doc = json.loads(path.read_text())
    doc["sessions"][0]["turns"][0]["hash_ids"].pop()
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="hash ids"):
        wl.load_trace(path)
    path.write_text('{"format": "glm53-agentic-trace/1", "block_tokens": 64, "sessions": [{"id": 1}]}')
    with pytest.raises(ValueError, match="session #0"):
        wl.load_trace(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        wl.load_trace(path)
    with pytest.raises(ValueError, match="trace-mode"):
        wl.save_trace(wl.openhands_sessions(1), path)


class VirtualClock:
    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    def sleep(self, s):
        self.t += s


class FakeEngine:
    """One token per running request per step (token = step number); at most `max_running` at once."""

    def __init__(self, max_running=8):
        self.clock = VirtualClock()
        self.max_running = max_running
        self.reqs = {}  # rid -> [prompt, max_new, produced, salt, arrival]
        self.log = []
        self.steps = 0

    def add_request(self, prompt, params, salt=""):
        rid = f"r{len(self.log)}"
        self.reqs[rid] = [np.asarray(prompt), params, 0, salt, self.clock.now()]
        self.log.append((rid, np.asarray(prompt).copy(), salt, self.clock.now()))
        return rid

    def has_unfinished(self):
        return bool(self.reqs)

    def step(self):
        self.steps += 1
        self.clock.t += 1.0
        out = []
        for rid in list(self.reqs)[: self.max_running]:
            r = self.reqs[rid]
            r[2] += 1
            fin = r[2] == r[1]
            out.append((rid, self.steps, fin))
            if fin:
                del self.reqs[rid]
        return out


def test_closed_loop_client_append_sessions_carry_outputs_and_respect_concurrency():
    sessions = wl.openhands_sessions(5, scale=1 / 1000, turns=3, think_s=2.0)
    eng = FakeEngine()
    in_flight = []
    client = wl.ClosedLoopClient(eng, sessions, concurrency=2, vocab_size=100, make_params=lambda n: n,
                                 salt_prefix="u:")
    res = client.run(on_step=lambda e: in_flight.append(len(e.reqs)))
    assert res.sessions_done == 5 and len(res.request_ids) == 15
    assert max(in_flight) <= 2
    by_salt = {}
    for rid, prompt, salt, t in eng.log:
        by_salt.setdefault(salt, []).append((prompt, t))
    assert sorted(by_salt) == [f"u:user{i}" for i in range(5)]
    for turns in by_salt.values():
        assert len(turns) == 3
        for (p0, _), (p1, _) in zip(turns, turns[1:]):
            # next prompt = previous prompt + the tokens generated for it + new input
            assert np.array_equal(p1[: p0.size], p0) and p1.size == p0.size + 1 + 1


def test_closed_loop_client_trace_prompts_are_their_blocks_tokens():
    """A trace turn's prompt is its hash ids' block tokens cut to input_tokens, whatever the previous turn
    sent: the client reuses the blocks a turn shares with the previous one (a prefix, none, or part of
    one that diverges), and a prompt it sent is not changed by the next."""
    turns = [wl.Turn(130, 1, hash_ids=(1, 2, 3)), wl.Turn(250, 1, hash_ids=(1, 2, 3, 4)),
             wl.Turn(200, 1, hash_ids=(1, 9, 3, 4)), wl.Turn(60, 1, hash_ids=(5,)), wl.Turn(190, 1, hash_ids=(5, 6, 7))]
    sessions = [wl.Session("s", "user0", tuple(turns), mode="trace")]
    eng, sent = FakeEngine(), []
    add = eng.add_request
    eng.add_request = lambda prompt, params, salt="": (sent.append(prompt), add(prompt, params, salt))[1]
    wl.ClosedLoopClient(eng, sessions, concurrency=1, vocab_size=1000, make_params=lambda n: n).run()
    assert len(sent) == len(turns)
    for prompt, t in zip(sent, turns):  # the arrays as sent, read after every later turn was built
        want = np.concatenate([wl.block_tokens(h, 1000) for h in t.hash_ids])[: t.input_tokens]
        assert prompt.dtype == want.dtype and np.array_equal(prompt, want)


def test_closed_loop_client_think_time_and_subagent_order():
    t = wl.Turn
    parent = wl.Session("p", "alice", (t(64, 2, 0.0, (1,)), t(128, 2, 5.0, (1, 2)), t(192, 2, 5.0, (1, 2, 3))), "trace")
    child = wl.Session("p.sub1", "alice", (t(128, 1, 0.0, (1, 2)),), "trace", "p", 1)
    bob = wl.Session("q", "bob", (t(64, 1, 0.0, (1,)),), "trace")
    eng = FakeEngine()
    wl.ClosedLoopClient(eng, [parent, child, bob], concurrency=3, vocab_size=50, make_params=lambda n: n,
                        think_time_scale=0.5, salt_prefix="s-").run()
    times = {i: ts for i, (_, _, _, ts) in enumerate(eng.log)}
    prompts = [p for _, p, _, _ in eng.log]
    salts = [s for _, _, s, _ in eng.log]
    # p turn 0 and q at t=0; p turn 1 sent 2.5 s after turn 0 finished (2 steps); the branch after it finished
    assert times[0] == 0.0 and times[1] == 0.0 and times[2] == pytest.approx(2.0 + 2.5)
    child_idx = next(i for i, (_, p, s, _) in enumerate(eng.log) if i > 2 and p.size == 128)
    assert times[child_idx] >= times[2] + 2
    # trace prompts are the hash blocks' tokens: the same ids give the same tokens, users get their own salt
    assert np.array_equal(prompts[0], prompts[1]) and salts[0] != salts[1]
    assert np.array_equal(prompts[2][:64], prompts[0]) and np.array_equal(prompts[child_idx], prompts[2])


def test_closed_loop_client_steady_window_and_stop_at_drain():
    t = wl.Turn
    turns = lambda *outs: tuple(t(64, n, 0.0, (1,)) for n in outs)  # noqa: E731
    sessions = [wl.Session("a", "u0", turns(2), "trace"), wl.Session("b", "u1", turns(4, 3, 4), "trace"),
                wl.Session("c", "u2", turns(1), "trace"), wl.Session("d", "u3", turns(3), "trace")]
    make = lambda: wl.ClosedLoopClient(FakeEngine(), sessions, concurrency=2, vocab_size=50,  # noqa: E731
                                       make_params=lambda n: n)
    # a and b start at t=0; a ends at t=2 and c takes its slot; c ends at t=3 and d, the last, takes it;
    # d ends at t=6 and its slot stays free: the pool of 2 was full over (0, 6); b runs alone to t=11
    full = make()
    res = full.run()
    assert res.steady_window == (0.0, 6.0) and full.engine.clock.now() == 11.0 and res.sessions_done == 4
    # stop_at_drain: waits for b's turn in flight at t=6 (its 2nd, t=4..7), then sends nothing more
    stop = make()
    res = stop.run(stop_at_drain=True)
    assert res.steady_window == (0.0, 6.0) and stop.engine.clock.now() == 7.0
    assert len(res.request_ids) == 5 and not stop.engine.reqs and res.sessions_done == 3
    with pytest.raises(ValueError, match="no steady part"):
        wl.ClosedLoopClient(FakeEngine(), sessions[:1], concurrency=2, vocab_size=50,
                            make_params=lambda n: n).run(stop_at_drain=True)
    assert wl.ClosedLoopClient(FakeEngine(), sessions[:2], concurrency=2, vocab_size=50,
                               make_params=lambda n: n).run().steady_window == (0.0, 2.0)
    assert wl.ClosedLoopClient(FakeEngine(), sessions[:1], concurrency=2, vocab_size=50,
                               make_params=lambda n: n).run().steady_window is None


def test_closed_loop_client_window_after_a_warm_up():
    """warmup_s / window_s: the window is (warm-up, warm-up + window) on the engine clock, the run stops
    once the requests in flight at its end have finished, and a pool that runs short of sessions inside
    it is an error (the window would not be steady)."""
    t = wl.Turn
    one = lambda i: wl.Session(f"s{i}", f"u{i}", (t(64, 2, 0.0, (1,)),), "trace")  # noqa: E731  2 steps each
    make = lambda n: wl.ClosedLoopClient(FakeEngine(), [one(i) for i in range(n)], concurrency=2,  # noqa: E731
                                         vocab_size=50, make_params=lambda n: n)
    # pairs of sessions start at t = 0, 2, 4, ...; at t=5 the window (1, 5) ends with s4, s5 in flight
    # (sent at 4); they finish at 6 and the run stops there: s6 and s7 took the slots but sent nothing
    c = make(12)
    res = c.run(stop_at_drain=True, warmup_s=1.0, window_s=4.0)
    assert res.steady_window == (1.0, 5.0) and c.engine.clock.now() == 6.0
    assert len(res.request_ids) == 6 and res.sessions_started == 6 and res.sessions_done == 6
    # a warm-up alone: from its end to where the pool ran short (12 sessions: the last pair starts at 10
    # and ends at 12, when no session is left)
    assert make(12).run(stop_at_drain=True, warmup_s=3.0).steady_window == (3.0, 12.0)
    with pytest.raises(ValueError, match=r"ran short of sessions at t=6.0 s"):  # 6 sessions last to t=6
        make(6).run(stop_at_drain=True, warmup_s=1.0, window_s=6.0)
    with pytest.raises(ValueError, match="ran short of sessions at t=2.0 s, before the end of the warm-up"):
        make(3).run(stop_at_drain=True, warmup_s=3.0)
    with pytest.raises(ValueError, match="need stop_at_drain"):
        make(12).run(window_s=4.0)


def test_client_rejects_sessions_over_the_admission_limit():
    with pytest.raises(ValueError, match="max_model_len"):
        wl.ClosedLoopClient(FakeEngine(), wl.openhands_sessions(1, scale=1 / 100), 1, vocab_size=10,
                            make_params=lambda n: n, max_model_len=500)


def test_config_loader_overrides(tmp_path):
    cfg = load_config(REPO / "configs/smoke.py", ["--config.sweep.concurrency=3", "--config.workload.scale=0.5",
                                           "--config.name=x"])
    assert cfg.sweep.concurrency == (3,) and cfg.workload.scale == 0.5 and cfg.name == "x"
    with pytest.raises(ValueError, match="no 'sweep.concurency'"):
        load_config(REPO / "configs/smoke.py", ["--config.sweep.concurency=3"])
    with pytest.raises(FileNotFoundError):
        load_config(str(tmp_path / "nope.py"))


def test_client_fails_loudly_when_the_engine_drops_a_request():
    class Forgetful(FakeEngine):
        def has_unfinished(self):
            return False  # never reports the request it was given

    with pytest.raises(RuntimeError, match="idle with requests in flight"):
        wl.ClosedLoopClient(Forgetful(), wl.openhands_sessions(1, scale=1 / 1000, turns=2), 1, vocab_size=10,
                            make_params=lambda n: n).run()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_trace_import(tmp_path):
    """aiperf's mooncake_trace JSONL: 512-token hash ids become 8 ids of 64-token blocks each (requests
    sharing a large block share its sub-blocks), session_id lines are one session's turns with delay as
    think time, a line without hash_ids shares nothing, and one user keeps the file's one hash namespace."""
    path = _jsonl(tmp_path / "mc.jsonl", [
        {"timestamp": 0, "input_length": 1200, "output_length": 52, "hash_ids": [0, 1, 2]},
        {"timestamp": 105, "input_length": 1800, "output_length": 26, "hash_ids": [0, 3, 4, 5]},
        {"timestamp": 200, "input_length": 700, "output_length": 9},
        {"session_id": "a", "timestamp": 300, "input_length": 600, "output_length": 5, "hash_ids": [6, 7]},
        {"session_id": "a", "delay": 1500, "input_length": 1100, "output_length": 5, "hash_ids": [6, 8, 9]},
    ])
    assert wl.detect_trace_format(path) == "mooncake"
    s = wl.read_trace(path)
    assert [x.session_id for x in s] == ["mc1", "mc2", "mc3", "a"] and {x.user for x in s} == {"mooncake"}
    t0, t1, t2 = s[0].turns[0], s[1].turns[0], s[2].turns[0]
    assert len(t0.hash_ids) == 19 and t0.hash_ids[:8] == tuple(range(8)) and t0.hash_ids[8:16] == tuple(range(8, 16))
    assert t1.hash_ids[:8] == t0.hash_ids[:8] and not set(t1.hash_ids[8:]) & set(t0.hash_ids)
    assert len(t2.hash_ids) == 11 and not set(t2.hash_ids) & {h for x in s if x is not s[2] for t in x.turns for h in t.hash_ids}
    a = s[3]
    assert [t.think_s for t in a.turns] == [0.0, 1.5] and a.turns[1].hash_ids[:8] == a.turns[0].hash_ids[:8]
    assert wl.trace_stats(s)["prefix_reuse"] > 0
    for bad, match in [({"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1]}, "need 3"),
                       ({"timestamp": 0, "messages": [], "output_length": 5}, "prompt text"),
                       ({"timestamp": 0, "output_length": 5}, "missing field 'input_length'")]:
        with pytest.raises(ValueError, match=match):
            wl.load_mooncake_trace(_jsonl(tmp_path / "bad.jsonl", [bad]))
    (tmp_path / "bad.jsonl").write_text('{"input_length": 1,\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        wl.load_mooncake_trace(tmp_path / "bad.jsonl")


def _weka(tid, scope="local"):
    req = lambda t, n, ids, **kw: {"t": t, "type": "n", "model": "m", "in": n, "out": 20, "hash_ids": ids, **kw}  # noqa: E731
    return {"id": tid, "models": ["m"], "block_size": 64, "hash_id_scope": scope, "requests": [
        req(0.0, 130, [0, 1, 2], api_time=2.0),
        {"t": 3.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore", "status": "completed",
         "models": ["m"], "requests": [
             req(3.0, 100, [0, 5], api_time=1.0),
             {"t": 4.5, "type": "subagent", "agent_id": "agent_002", "subagent_type": "Explore", "status": "completed",
              "models": ["m"], "requests": [req(4.5, 64, [0])]},
             req(5.0, 150, [0, 5, 6], think_time=0.25)]},
        req(7.0, 200, [0, 1, 2, 7], api_time=1.0),
    ]}


def test_weka_agentic_trace_import(tmp_path):
    """Weka / SemiAnalysis agentic-coding traces: a trace is a session, each subagent (nested too) a
    session of the same user branching after its parent's last request before the marker; think time is
    think_time, else the gap since the previous request ended; "local" scope gives each trace its own user
    (salted apart), "global" one user for all. Read from a file, a JSONL of rows or a directory."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_weka("tr1")))
    assert wl.detect_trace_format(path) == "weka"
    s = wl.read_trace(path)
    assert [(x.session_id, x.parent, x.branch_after_turn) for x in s] == [
        ("tr1", None, None), ("tr1/agent_001", "tr1", 0), ("tr1/agent_001/agent_002", "tr1/agent_001", 0)]
    main, sub, subsub = s
    assert [t.input_tokens for t in main.turns] == [130, 200] and [t.think_s for t in main.turns] == [0.0, 5.0]
    assert [t.think_s for t in sub.turns] == [0.0, 0.25] and subsub.turns[0].hash_ids == (0,)
    assert {x.user for x in s} == {"tr1"}
    rows = _jsonl(tmp_path / "rows.jsonl", [_weka("tr1"), _weka("tr2")])
    assert {x.user for x in wl.read_trace(rows)} == {"tr1", "tr2"}
    (tmp_path / "dir").mkdir()
    for tid in ("a", "b"):
        (tmp_path / "dir" / f"{tid}.json").write_text(json.dumps(_weka(tid, "global")))
    both = wl.read_trace(tmp_path / "dir")
    assert len(both) == 6 and {x.user for x in both} == {"global"}
    saved = tmp_path / "ours.json"  # imported traces save in our format and read back the same
    wl.save_trace(both, saved)
    assert wl.detect_trace_format(saved) == "glm53" and wl.read_trace(saved) == both
    bad = _weka("x")
    bad["requests"][0]["hash_ids"] = [0, 1]
    for doc, match in [(bad, "request #0: 130 input tokens need 3"),
                       ({**_weka("x"), "block_size": 100}, "not a multiple of 64"),
                       ({**_weka("x"), "hash_id_scope": "corpus"}, "hash_id_scope"),
                       ({"id": "x", "requests": [{"type": "q"}]}, "unknown request type 'q'")]:
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=match):
            wl.read_trace(path, "weka")
    with pytest.raises(ValueError, match="trace format must be one of"):
        wl.read_trace(path, "csv")
