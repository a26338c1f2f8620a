"""A runner with no model and no arrays: it executes step plans by completing their transfers at once
and returning synthetic tokens. It drives the real scheduler, block pool and KV policies cheaply (the
scheduler benchmark, the scheduler's state-machine test, and the check that a plan is all a runner
needs: the same requests give the same block-pool history as under the model runner).

Secondary tiers (the offload policy's `TierStore` / `TierLoad`) run on simulated tiers
(kvcache.tiers.sim.SimTier: keys and sizes, no bytes) that the engine asks the runner for
(`make_tiers`). They see the runner's time: a SyntheticRunner has no priced steps, so its time moves
only when a step has nothing to compute and waits for a tier (to the next store or load it finishes);
the simulator (glm53.engine.sim.SimRunner) follows the engine's virtual clock and its priced steps.

`ContentRunner` is a SyntheticRunner that sees KV contents: it keeps a synthetic value per cache slot,
moves the values as the model runner moves bytes, and derives every token from the values its position
is served (`ContentModel`), so a check of its tokens against `ContentModel.expected` (what a request
gets with all its KV resident) fails on any wrong page served: the scheduler's state machine runs on it.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from glm53.engine.config import DeployConfig, KVSizes
from glm53.engine.plan import PlanRow, StepPlan, StepResult
from glm53.engine.request import SamplingParams
from glm53.engine.spec_decode import SpeculativeConfig
from kvcache.policies.hisparse import HiSparseRow
from kvcache.tiers import TierSet
from kvcache.tiers.sim import INSTANT, SimTier, TierCosts
from kvcache.transfer import LoadKV, PageCopy, ResetLease, SaveKV, TierLoad, TierStore, Transfer, bytes_moved


class SyntheticRunner:
    """`glm53.engine.plan.Runner` without a model.

    token: the token a sampling row returns (default: 0 for every row).
    page_bytes: per cache group, bytes of one page (kvcache.layout.page_bytes, e.g. `Engine.sizes`), to
        count what the transfers move; None: no plan may carry a transfer that moves KV.
    record: keep every executed transfer in `executed` (in execution order).
    tier_costs: per secondary-tier type ("fs", ...), the simulated device behind it
        (kvcache.tiers.sim.TierCosts); None: every type costs nothing (loads finish when submitted).
    spec: MTP (glm53.engine.spec_decode.SpeculativeConfig, e.g. `DeployConfig.speculative`), or None. The
        target's token at each position a row verifies is `token` of the row cut there (a row computing
        positions [start, p] with num_generated counting the drafts before p). Standard rule: a draft
        stands iff it is that token. Synthetic: the number of drafts that stand comes from the rates with
        a uniform hashed from (request, tokens generated). Drafts for the next step: `draft(row, i)` for a
        row cut as the next step's i-th verified position (default: `token` itself, a drafter that is
        always right).
    """

    def __init__(self, token: Callable[[PlanRow], int] | None = None, page_bytes: Mapping[str, int] | None = None,
                 record: bool = False, tier_costs: Mapping[str, TierCosts] | None = None, *,
                 spec: SpeculativeConfig | None = None, draft: Callable[[PlanRow], int] | None = None):
        self.token = token or (lambda row: 0)
        self.page_bytes = page_bytes
        self.executed: list[Transfer] | None = [] if record else None
        self.steps = 0
        self.spec = spec
        self.draft = draft or self.token
        self.tier_costs = tier_costs
        self.tiers: TierSet | None = None
        self._t = 0.0  # the runner's time: "now" for its simulated tiers

    def make_tiers(self, specs: Sequence[dict], fingerprint: str = "", replica: int = 0) -> TierSet:
        """Simulated tiers for DeployConfig's secondary_tiers entries (the engine calls this instead of
        kvcache.tiers.make_tier): one SimTier per entry, named as the entry names it ("name", else its
        type), holding up to its "max_bytes", on the device `tier_costs` gives its type. The runner then
        executes the plans' TierStore / TierLoad on them and reports finished loads."""
        tiers = []
        for spec in specs:
            kind = spec.get("type")
            if self.tier_costs is None:
                costs = INSTANT
            elif kind in self.tier_costs:
                costs = self.tier_costs[kind]
            else:
                raise ValueError(f"the simulator has no cost model for a secondary tier of type {kind!r} "
                                 f"(types with one: {sorted(self.tier_costs)})")
            tiers.append(SimTier(clock=self._now, costs=costs, max_bytes=spec.get("max_bytes"),
                                 name=spec.get("name") or kind))
        self.tiers = TierSet(tiers)
        return self.tiers

    def _now(self) -> float:
        return self._t

    def execute(self, plan: StepPlan) -> StepResult:
        res = self._run(plan)
        _, loads = self._end_step(plan, 0.0)
        return dataclasses.replace(res, tier_loads=loads) if loads else res

    def _run(self, plan: StepPlan) -> StepResult:
        """The plan's transfers (tier jobs submitted at the runner's time now) and its tokens."""
        d2h = h2d = 0
        for op in plan.transfers:
            if self.page_bytes is None and not isinstance(op, ResetLease):
                raise ValueError("SyntheticRunner: a plan moves KV but the runner has no page_bytes to count it")
            a, b = bytes_moved(op, self.page_bytes or {})
            d2h, h2d = d2h + a, h2d + b
            self._apply(op)
        if self.executed is not None:
            self.executed.extend(plan.transfers)
        self.steps += 1
        tokens, drafts = self._tokens(plan)
        return StepResult(tokens, frozenset(range(len(plan.transfers))), d2h, h2d, drafts=drafts)

    def _apply(self, op: Transfer) -> None:
        """Execute one transfer: only the secondary tiers' jobs do anything here (no bytes to move)."""
        if isinstance(op, (TierStore, TierLoad)):
            self._submit(op)

    def _tokens(self, plan: StepPlan) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """The forward and sampling: (tokens, drafts) of the rows that sample (drafts empty without MTP)."""
        if self.spec is None:
            return {row.req_id: (int(self.token(row)),) for row in plan.rows if row.sample}, {}
        tokens, drafts = {}, {}
        for row in plan.rows:
            if row.sample:
                tokens[row.req_id], drafts[row.req_id] = self._verify(row)
        return tokens, drafts

    def _verify(self, row: PlanRow) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A row's tokens under MTP (the drafts that stood, then the target's next) and its next drafts."""
        nd, k = row.num_draft_tokens, self.spec.num_speculative_tokens
        known = row.num_tokens - nd  # the row's tokens before its drafts
        given = [int(t) for t in row.token_ids[known:]]
        accepted = _synthetic_accepted(row, self.spec)
        if accepted is None:
            accepted = next((i for i, d in enumerate(given) if d != int(self.token(_cut(row, known + i)))), nd)
        out = tuple(given[:accepted]) + (int(self.token(_cut(row, known + accepted))),)
        first = known + accepted + 1  # the next step verifies from the position after this row's last token
        return out, tuple(int(self.draft(_cut(row, first + i))) for i in range(k))

    def _submit(self, op: TierStore | TierLoad) -> None:
        if self.tiers is None:
            raise ValueError("SyntheticRunner: a plan moves KV to or from secondary tiers, but the runner made none "
                             "(the engine calls make_tiers)")
        size = self.page_bytes[op.group]
        if isinstance(op, TierStore):  # the sizes stand for the host pages' bytes
            self.tiers.store(op.keys, (size,) * len(op.keys))
        else:  # one job per chunk, as kvcache.host.HostMemory submits them
            for job, key in zip(op.jobs, op.keys):
                self.tiers.load(op.tier, job, (key,), (size,))

    def _end_step(self, plan: StepPlan, seconds: float) -> tuple[float, tuple[tuple[int, str], ...]]:
        """The step takes `seconds` from the runner's time now; one that computes nothing while its tiers
        have jobs pending lasts until the first of them finishes (a load first: the only requests left are
        waiting for one, or for a store a lookup answered RETRY to). -> (seconds, the loads finished by the
        step's end, as StepResult.tier_loads)."""
        if self.tiers is None:
            self._t += seconds
            return seconds, ()
        if not plan.rows:
            tiers = self.tiers.tiers
            nxt = min((t for x in tiers if (t := x.next_load_s()) is not None), default=None)
            if nxt is None:
                nxt = min((t for x in tiers if (t := x.next_event_s()) is not None), default=None)
            if nxt is not None:
                seconds = max(seconds, nxt - self._t)
        self._t += seconds
        return seconds, tuple((r.job_id, r.status[0]) for r in self.tiers.poll())


def _synthetic_accepted(row: PlanRow, spec: SpeculativeConfig) -> int | None:
    """How many of the row's drafts stand under the synthetic acceptance rule (a uniform hashed from the
    request and its tokens generated, against the configured rates), or None under the standard rule."""
    rates = spec.acceptance_rates
    if rates is None:
        return None
    u = zlib.crc32(f"{row.req_id}:{row.num_generated}:accept".encode()) / 2 ** 32
    return sum(1 for r in rates[:row.num_draft_tokens] if u < r)


def _cut(row: PlanRow, n: int) -> PlanRow:
    """`row` as a row of its first n positions (tokens past its own are zeros): what a non-speculative
    step computing up to position start + n - 1 would be, num_generated counting the tokens between."""
    known = row.num_tokens - row.num_draft_tokens
    ids = np.zeros(n, np.int32)
    ids[: min(n, row.num_tokens)] = row.token_ids[:n]
    # the constructor, not dataclasses.replace: a simulated MTP step cuts every row 1 + 2k times
    return PlanRow(row.req_id, row.start, ids, row.sample, row.params, row.num_generated + n - known, 0,
                   row.next_token)


# ------------------------------------------------------------------------ a runner that sees KV contents
_MASK = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads positions over 64 bits
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers
_INDEX_SALT = 0x5851F42D4C957F2D  # keeps an indexer term apart from an MLA term of the same value


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int: a bijection of 64-bit values that spreads every input bit."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK
    return x ^ (x >> 31)


def _mix_v(x: np.ndarray) -> np.ndarray:
    """`_mix` elementwise on a uint64 array (numpy's uint64 array arithmetic wraps modulo 2^64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_MUL1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_MUL2)
    return x ^ (x >> np.uint64(31))


def _term_v(pos: np.ndarray, vals: np.ndarray, salt: int = 0) -> np.ndarray:
    """Per read position a hash of (position, content, salt): summed, a row that reads a page's contents at
    another position's place, or a stale or never-written slot, sums to something else."""
    return _mix_v(vals ^ (pos.astype(np.uint64) * np.uint64(_GOLD) ^ np.uint64(salt)))


def _terms(pos: np.ndarray, vals: np.ndarray) -> int:
    """Sum (mod 2^64) of `_term_v` over the MLA rows read."""
    return int(_term_v(pos, vals).sum(dtype=np.uint64)) if len(pos) else 0


@dataclasses.dataclass(frozen=True)
class ContentModel:
    """The synthetic model `ContentRunner` runs: a stand-in for GLM-5.3's attention over a paged cache with
    two cache groups, in which every value depends on what the cache serves.

    At position q (token t_q), the row reads the indexer keys of every earlier position (the indexer
    scores them all) and the MLA rows of the positions the indexer selects: all q earlier positions while
    q <= topk, else the topk with the highest score hash(q, key). Its hidden state is
        h_q = hash(t_q, q, sum over selected p of hash(p, mla_p), sum over p < q of hash(p, key_p)),
    it writes mla_q = hash(h_q, 1) and key_q = hash(h_q, 2), and the token sampled after it is
    hash(h_q) mod vocab (the next hash while that is a banned stop token, as the model masks them).
    So a token depends on every indexer key before it and every MLA row it selects, and every written row
    on those read before it: one wrong row served anywhere changes every later token with near certainty.
    `expected` computes the same with every row resident (from the token history alone)."""

    topk: int
    vocab: int = 97

    def select(self, q: int, keys: np.ndarray) -> np.ndarray:
        """Positions (int64, any order) the query at q selects, from the indexer keys of positions < q."""
        if q <= self.topk:
            return np.arange(q)
        scores = _mix_v(keys[:q] ^ np.uint64((q * _GOLD) & _MASK))
        return np.argpartition(scores, q - self.topk)[q - self.topk:]

    @staticmethod
    def hidden(token: int, q: int, mla_sum: int, key_sum: int) -> int:
        return _mix(_mix(_mix(token * _GOLD + q) ^ mla_sum) + key_sum)

    @staticmethod
    def rows(h: int) -> tuple[int, int]:
        """What position q writes: (its MLA row, its indexer key)."""
        return _mix(h ^ 1), _mix(h ^ 2)

    @staticmethod
    def key_term(q: int, key: int) -> int:
        """`_term_v` of one indexer key (salted apart from the MLA rows' terms)."""
        return _mix(key ^ ((q * _GOLD) & _MASK) ^ _INDEX_SALT)

    def pick(self, h: int, banned: tuple[int, ...] = ()) -> int:
        """The token sampled after a position of hidden state h: hash(h) mod vocab, or the next id up
        (cyclically) that is not banned."""
        if len(set(banned) & set(range(self.vocab))) >= self.vocab:
            raise ValueError(f"every token of the synthetic vocabulary ({self.vocab}) is a banned stop token")
        t = _mix(h) % self.vocab
        while t in banned:
            t = (t + 1) % self.vocab
        return t

    def expected(self, prompt_ids, output_ids, params: SamplingParams) -> tuple[int, ...]:
        """The outputs a request of `prompt_ids` gets with all its KV resident, given its own outputs
        `output_ids` as its history: the j-th is the token after prompt + output_ids[:j]. A runner that
        served every row right returned exactly `output_ids`."""
        ids = [int(t) for t in prompt_ids] + [int(t) for t in output_ids]
        n0, n = len(prompt_ids), len(ids)
        mla, keys = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
        key_sum, out = 0, []
        for q in range(n - 1):
            sel = self.select(q, keys)
            h = self.hidden(ids[q], q, _terms(sel, mla[sel]), key_sum)
            mla[q], keys[q] = self.rows(h)
            key_sum = (key_sum + self.key_term(q, int(keys[q]))) & _MASK
            if q >= n0 - 1:
                out.append(self.pick(h, params.banned(q - n0 + 1)))
        return tuple(out)


class _Hot:
    """One HiSparse lease's hot buffer: `rows`, the device slots (flat, block x page rows + row) its leased
    blocks give it; which position each holds; least recently used first."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows
        self.pos_of: dict[int, int] = {}  # slot -> position
        self.slot_of: dict[int, int] = {}  # position -> slot
        self.lru = collections.OrderedDict((s, None) for s in range(len(rows)))  # empty slots first


class _RowKV:
    """What one row's forward reads from the cache in one step, the way the model runner's forward for it
    would read it. `path`: "device" (block tables only), "staged" (a HiSparse prefill chunk: a page with
    no device block is read from its host page, kvcache.views.StagingView) or "resolve" (a HiSparse decode
    row with a hot buffer: host-only rows through the lease's hot slots, attention.hisparse)."""

    def __init__(self, runner: ContentRunner, row: PlanRow, tables: dict[str, np.ndarray], hs: HiSparseRow | None,
                 path: str):
        self.r, self.row, self.tables, self.path = runner, row, tables, path
        self.host = np.asarray(hs.host_blocks if hs is not None else (), np.int64)
        self.lease = hs.lease if hs is not None else -1
        end = row.start + row.num_tokens + runner.num_drafts + 1
        self.keys = np.zeros(end, np.uint64)  # indexer keys of the positions read or computed so far
        self.key_sums = [0] * (end + 1)  # key_sums[q]: sum of key terms over positions < q
        self.virtual_from = end  # positions from here hold `overlay` rows (draft passes: not written)
        self.overlay: dict[int, int] = {}
        start = row.start
        if start:
            pos = np.arange(start)
            self.keys[:start] = runner._read("indexer", tables["indexer"], pos, "indexer keys")
            terms = np.cumsum(_term_v(pos, self.keys[:start], _INDEX_SALT), dtype=np.uint64)
            self.key_sums[1: start + 1] = [int(x) for x in terms]

    def mla(self, pos: np.ndarray) -> np.ndarray:
        """The MLA rows at positions `pos` as the row's forward is served them."""
        vals = np.empty(len(pos), np.uint64)
        virt = pos >= self.virtual_from
        for i in np.flatnonzero(virt):
            vals[i] = self.overlay[int(pos[i])]
        real = ~virt
        if self.path == "device":
            vals[real] = self.r._read("mla", self.tables["mla"], pos[real], "MLA rows")
            return vals
        r, tpb = self.r, self.r.tpb["mla"]
        p = pos[real]
        page, off = p // tpb, p % tpb
        blk = self.tables["mla"][page]
        got = np.empty(len(p), np.uint64)
        on = blk >= 0
        got[on] = r.dev["mla"][blk[on] * tpb + off[on]]
        away = np.flatnonzero(~on)  # pages with no device block: the host page's rows, staged or hot
        if len(away):
            hb = np.full(len(away), -1, np.int64)
            has = page[away] < len(self.host)
            hb[has] = self.host[page[away][has]]
            src = np.where(hb >= 0, hb * tpb + off[away], -1)
            if self.path == "resolve":
                got[away] = r._resolve(self.row.req_id, self.lease, p[away], src)
            else:
                if (src < 0).any():
                    raise RuntimeError(f"HiSparse: request {self.row.req_id!r} selected rows with no device page or "
                                       f"host copy: positions {p[away][src < 0].tolist()}")
                got[away] = r.host["mla"][src]
                r.counts["staged_rows"] += len(away)
        vals[real] = got
        return vals

    def hidden(self, token: int, q: int) -> int:
        """h_q of the row's token `token` at position q (positions < q written or overlaid)."""
        m = self.r.model
        sel = m.select(q, self.keys)
        return m.hidden(token, q, _terms(sel, self.mla(sel)), self.key_sums[q])

    def write(self, q: int, h: int) -> None:
        """Write position q's rows into the cache, and read its key back for the positions after it."""
        mla, key = self.r.model.rows(h)
        self.r._write("mla", self.tables["mla"], q, mla, self.row.req_id)
        self.r._write("indexer", self.tables["indexer"], q, key, self.row.req_id)
        self._known(q, int(self.r._read("indexer", self.tables["indexer"], np.array([q]), "indexer keys")[0]))

    def virtual(self, q: int, h: int) -> None:
        """A draft pass's position: its rows exist for the passes after it, not in the cache."""
        mla, key = self.r.model.rows(h)
        self.virtual_from = min(self.virtual_from, q)
        self.overlay[q] = mla
        self._known(q, key)

    def _known(self, q: int, key: int) -> None:
        self.keys[q] = key
        self.key_sums[q + 1] = (self.key_sums[q] + self.r.model.key_term(q, key)) & _MASK


class ContentRunner(SyntheticRunner):
    """`glm53.engine.plan.Runner` whose tokens depend on the KV contents the plan makes it read: a wrong,
    stale or swapped page served to any row changes that request's tokens.

    It keeps a synthetic content (a 64-bit value) per device slot (block id, row of the page) of each cache
    group, per host-pool slot, per swapped-out copy and per secondary-tier chunk, and moves them as the
    model runner moves bytes (kvcache.host.HostMemory): a plan's transfers in order (page copies
    device<->host, swap saves and loads, tier stores snapshot host pages, a finished tier load writes its
    host pages, a lease reset empties a hot buffer), then each row's positions one after the other, each
    reading what `ContentModel` says a position reads, through the path the model runner's forward would
    take for that row (`_RowKV`), and writing its rows through its block tables. A row that samples
    returns `ContentModel.pick` of its last position. So `ContentModel.expected` over a request's history
    is what it must return, and a machine that checks that sees every wrong page that is read.

    Under MTP (`deploy.speculative`) a verify row computes every position it carries (its drafts' rows are
    written, as the verify forward writes them, and rewritten once rejected); the target's token at each
    position decides which drafts stand (standard rule: a draft stands iff it is the target's token;
    synthetic: the configured rates decide, as SyntheticRunner's). The next drafts come from draft passes
    over the positions after the last that stands, reading the cache below it and their own rows above
    it, never writing: a drafter that is right unless `draft_error_rate` (a hash of the pass's state
    against it) makes it propose another token.

    Raises RuntimeError where the model runner would fail or read garbage: a row served a position with
    no device page, host copy or hot slot, a write through a -1 block, an unknown swap copy or tier chunk.
    The MTP layer's own KV and IndexShare's shared layers are not modelled: one layer per group.

    cfg: the model config (its index_topk: what a position selects); deploy / sizes: the resolved
    DeployConfig and KVSizes of the replica (pages per group, pool sizes, hot-buffer rows, MTP).
    counts: transfers executed per type, hot-buffer hits and misses, staged rows read (a test's coverage).
    """

    def __init__(self, cfg, deploy: DeployConfig, sizes: KVSizes, *, vocab: int = 97, draft_error_rate: float = 0.0,
                 tier_costs: Mapping[str, TierCosts] | None = None, record: bool = False):
        if not 0 <= draft_error_rate <= 1:
            raise ValueError(f"ContentRunner: draft_error_rate must be in [0, 1], got {draft_error_rate!r}")
        super().__init__(page_bytes=sizes.page_bytes, record=record, tier_costs=tier_costs, spec=deploy.speculative)
        self.model = ContentModel(cfg.index_topk, vocab)
        self.tpb = deploy.group_tokens_per_block(tuple(sizes.page_bytes))
        self.num_drafts = deploy.num_speculative_tokens
        self.draft_error_rate = draft_error_rate
        self.hot_rows = sizes.hot_rows
        self.dev = {g: np.zeros(sizes.num_blocks * n, np.uint64) for g, n in self.tpb.items()}
        self.host = {g: np.zeros(sizes.host_blocks.get(g, 0) * n, np.uint64) for g, n in self.tpb.items()}
        self.saved: dict[str, dict[str, np.ndarray]] = {}  # swap copies: key -> group -> [pages, page rows]
        self.chunks: dict[tuple[int, bytes], np.ndarray] = {}  # (tier, key) -> the page rows it stores
        self.loading: dict[int, tuple[int, str, int, bytes]] = {}  # tier load job -> (tier, group, host block, key)
        self.hot: dict[int, _Hot] = {}
        self.counts = collections.Counter()

    # --------------------------------------------------------------------------------------- transfers
    def _pages(self, group: str, blocks) -> np.ndarray:
        """Flat slots of whole pages `blocks` of `group`: [len(blocks), page rows]."""
        n = self.tpb[group]
        return np.asarray(blocks, np.int64)[:, None] * n + np.arange(n)

    def _apply(self, op: Transfer) -> None:
        self.counts[type(op).__name__] += 1
        if isinstance(op, PageCopy):
            src, dst = self._pages(op.group, op.src), self._pages(op.group, op.dst)
            if op.direction == "d2h":
                self.host[op.group][dst] = self.dev[op.group][src]
            else:
                self.dev[op.group][dst] = self.host[op.group][src]
        elif isinstance(op, SaveKV):
            if op.key in self.saved:
                raise RuntimeError(f"a host copy named {op.key!r} already exists")
            self.saved[op.key] = {g: self.dev[g][self._pages(g, b)] for g, b in op.blocks}
        elif isinstance(op, LoadKV):
            if op.key not in self.saved:
                raise RuntimeError(f"LoadKV of {op.key!r}: no such host copy")
            saved = self.saved.pop(op.key)
            for g, b in op.blocks:
                if len(b) != len(saved[g]):
                    raise RuntimeError(f"LoadKV of {op.key!r}: {len(b)} {g} blocks for a copy of {len(saved[g])}")
                self.dev[g][self._pages(g, b)] = saved[g]
        elif isinstance(op, ResetLease):
            rows = self._pages("mla", op.blocks).reshape(-1)[: self.hot_rows]
            if len(rows) < self.hot_rows:
                raise RuntimeError(f"ResetLease {op.lease}: {len(op.blocks)} blocks hold fewer than the hot buffer's "
                                   f"{self.hot_rows} rows")
            self.hot[op.lease] = _Hot(rows)
        elif isinstance(op, TierStore):  # the bytes are snapshotted now; a tier holding the key keeps its own
            rows = self.host[op.group][self._pages(op.group, op.host_blocks)]
            for i, t in enumerate(self.tiers.tiers if self.tiers is not None else ()):
                for key, r in zip(op.keys, rows):
                    if (i, key) not in self.chunks or key not in t:
                        self.chunks[(i, key)] = r.copy()
        elif isinstance(op, TierLoad):
            for job, key, hb in zip(op.jobs, op.keys, op.host_blocks):
                self.loading[job] = (op.tier, op.group, hb, key)
        super()._apply(op)

    def _end_step(self, plan: StepPlan, seconds: float) -> tuple[float, tuple[tuple[int, str], ...]]:
        """A tier load that finished "ok" writes its chunk's rows into its host page (HostMemory.poll_tiers)."""
        seconds, loads = super()._end_step(plan, seconds)
        for job, status in loads:
            tier, group, hb, key = self.loading.pop(job)
            if status == "ok":
                if (tier, key) not in self.chunks:
                    raise RuntimeError(f"tier {tier} loaded chunk {key!r} that no TierStore of this runner wrote")
                self.host[group][self._pages(group, [hb])[0]] = self.chunks[(tier, key)]
        return seconds, loads

    # ------------------------------------------------------------------------------------------ reads
    def _read(self, group: str, table: np.ndarray, pos: np.ndarray, what: str) -> np.ndarray:
        """Device contents at positions `pos` through a block table (-1: no device block: an error)."""
        n = self.tpb[group]
        page = pos // n
        if len(pos) and page.max() >= len(table):
            raise RuntimeError(f"{what} read past the block table ({len(table)} pages) at positions {pos.tolist()}")
        blk = table[page]
        if (blk < 0).any():
            raise RuntimeError(f"{what} read from pages with no device block at positions {pos[blk < 0].tolist()}")
        return self.dev[group][blk * n + pos % n]

    def _write(self, group: str, table: np.ndarray, q: int, value: int, req_id: str) -> None:
        n = self.tpb[group]
        if q // n >= len(table) or table[q // n] < 0:
            raise RuntimeError(f"request {req_id!r} writes position {q} of {group} where its block table has no block")
        self.dev[group][table[q // n] * n + q % n] = value

    def _resolve(self, req_id: str, lease: int, pos: np.ndarray, host_slots: np.ndarray) -> np.ndarray:
        """Rows of positions `pos` (not on the device) through lease `lease`'s hot buffer: a hit reads its
        slot; a miss copies the host row into the least recently used slot no read of this call used."""
        if lease not in self.hot:
            raise RuntimeError(f"request {req_id!r} reads through hot buffer {lease}, which no ResetLease gave blocks")
        hot, dev = self.hot[lease], self.dev["mla"]
        used, out = set(), np.empty(len(pos), np.uint64)
        for i, (p, src) in enumerate(zip(pos.tolist(), host_slots.tolist())):
            s = hot.slot_of.get(p)
            if s is None:
                if src < 0:
                    raise RuntimeError(f"HiSparse: request {req_id!r} selected position {p}: no device page, host copy "
                                       f"or hot slot")
                s = next(x for x in hot.lru if x not in used)
                old = hot.pos_of.pop(s, None)
                if old is not None:
                    del hot.slot_of[old]
                dev[hot.rows[s]] = self.host["mla"][src]
                hot.pos_of[s], hot.slot_of[p] = p, s
                self.counts["hot_misses"] += 1
            else:
                self.counts["hot_hits"] += 1
            hot.lru.move_to_end(s)
            used.add(s)
            out[i] = dev[hot.rows[s]]
        return out

    # ---------------------------------------------------------------------------------------- forward
    def _tokens(self, plan: StepPlan) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        tokens, drafts = {}, {}
        for i, row in enumerate(plan.rows):
            hs = plan.policy_rows[i] if plan.policy_rows is not None else None
            decode = row.num_draft_tokens > 0 or row.num_tokens == 1  # the model runner's decode / verify bucket
            path = "device" if hs is None else ("resolve" if hs.lease >= 0 else "device") if decode else "staged"
            tables = {g: np.asarray(t[i], np.int64) for g, t in plan.block_tables.items()}
            kv = _RowKV(self, row, tables, hs, path)
            states = []
            for j in range(row.num_tokens):
                q = row.start + j
                states.append(kv.hidden(int(row.token_ids[j]), q))
                kv.write(q, states[-1])
            if row.sample:
                tokens[row.req_id], nxt = self._sample(row, states, kv)
                if self.spec is not None:
                    drafts[row.req_id] = nxt
        return tokens, drafts

    def _sample(self, row: PlanRow, states: list[int], kv: _RowKV) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A sampling row's tokens (drafts that stood, then the target's) and, under MTP, its next drafts."""
        m, ban = self.model, row.params.banned
        nd = row.num_draft_tokens
        known = row.num_tokens - nd
        target = [m.pick(states[known - 1 + i], ban(row.num_generated + i)) for i in range(nd + 1)]
        given = [int(t) for t in row.token_ids[known:]]
        accepted = _synthetic_accepted(row, self.spec) if self.spec is not None else None
        if accepted is None:
            accepted = next((i for i, d in enumerate(given) if d != target[i]), nd)
        out = tuple(given[:accepted]) + (target[accepted],)
        if self.spec is None:
            return out, ()
        last = row.start + known - 1 + accepted  # the last position whose rows stand
        kv.virtual_from = last + 1
        n, tok, nxt = row.num_generated + accepted + 1, out[-1], []
        for i in range(self.num_drafts):
            h = kv.hidden(tok, last + 1 + i)
            kv.virtual(last + 1 + i, h)
            tok = m.pick(h, ban(n + i))
            if _mix(h ^ _INDEX_SALT) < self.draft_error_rate * 2 ** 64:  # a wrong proposal now and then
                tok = (tok + 1) % m.vocab
            nxt.append(tok)
        return out, tuple(nxt)
