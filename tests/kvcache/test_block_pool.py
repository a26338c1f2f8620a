"""Block pool and KV-cache manager: invariants under random operation sequences (hypothesis), prefix
reuse, salts, LRU eviction order and all-or-nothing allocation."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.block_pool import ARCBlockPool, BlockPool, KVCacheManager, NoFreeBlocks, block_hashes, hash_block


def test_hashes_chain_over_parents_tokens_and_salt():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the partial last block has no hash
    assert a == block_hashes([1, 2, 3, 4, 5, 6, 8], 2)
    assert block_hashes([9, 2, 3, 4], 2)[1] != a[1]  # a different earlier block changes every later hash
    assert block_hashes([1, 2, 3, 4], 2, ["user-a"]) != block_hashes([1, 2, 3, 4], 2, ["user-b"])
    assert hash_block(None, [1, 2]) == a[0] and len(a[0]) == 32


def test_hashes_taken_from_recent_chains_are_the_chain_hashes():
    """block_hashes reuses the hashes of a recent call over the same leading tokens (`_CHAINS`): over
    random prefixes, divergences, salts, `known` and `upto`, each result equals the chain hash_block
    computes block by block, and a chain cut short by the memory bound is only recomputed."""
    import numpy as np

    from kvcache import block_pool

    def chain(tokens, tpb, salt, upto):
        end = len(tokens) if upto is None else min(upto, len(tokens))
        out, parent = [], None
        for b in range(end // tpb):
            parent = hash_block(parent, tokens[b * tpb:(b + 1) * tpb], salt)
            out.append(parent)
        return out

    rng = np.random.default_rng(1)
    base = rng.integers(0, 1000, 2000)
    for bound in (block_pool._CHAINS_MAX_TOKENS, 500):
        block_pool._CHAINS_MAX_TOKENS = bound
        try:
            for _ in range(200):
                tpb, salt = int(rng.choice([2, 4, 16])), [] if rng.random() < .5 else [f"u{rng.integers(3)}"]
                tokens = base[:int(rng.integers(0, 2000))].copy()
                if tokens.size and rng.random() < .5:
                    tokens[rng.integers(tokens.size)] = 5000  # diverges from the chains before
                upto = None if rng.random() < .7 else int(rng.integers(0, 2200))
                want = chain(tokens, tpb, salt, upto)
                known = want[:int(rng.integers(0, len(want) + 1))] if rng.random() < .5 else []
                assert block_hashes(list(tokens) if rng.random() < .3 else tokens, tpb, salt, known=known,
                                    upto=upto) == want
        finally:
            block_pool._CHAINS_MAX_TOKENS = 1 << 23
    assert 0 < block_pool._chains_tokens == sum(t.size for cs in block_pool._CHAINS.values() for t, _ in cs)


def test_a_kept_chain_does_not_change_with_the_callers_tokens():
    """A chain `block_hashes` keeps is its own copy of the tokens: a caller that changes its array after the
    call (int64, hashed through a view of it; int32 and lists, through a converted copy) cannot make a later
    call reuse hashes of tokens it no longer has."""
    import numpy as np

    rng = np.random.default_rng(7)
    for make in (lambda a: a.astype(np.int64), lambda a: a.astype(np.int32), lambda a: [int(t) for t in a]):
        orig = rng.integers(0, 1000, 64)
        tokens = make(orig)
        first = block_hashes(tokens, 4, ["kept-chain"])
        tokens[10] = 5000  # the caller reuses its buffer
        assert block_hashes(orig.copy(), 4, ["kept-chain"]) == first
        changed = orig.copy()
        changed[10] = 5000
        assert block_hashes(changed, 4, ["kept-chain"])[:2] == first[:2]
        assert block_hashes(changed, 4, ["kept-chain"])[2] != first[2]


def test_lru_reuse_and_eviction_order():
    pool = BlockPool(4)
    b = pool.allocate(3)
    assert b == [0, 1, 2]
    for i, blk in enumerate(b):
        pool.cache("mla", blk, bytes([i]))
    pool.free([2, 1, 0])  # freed tail first: block 2 is evicted first
    assert pool.lookup("mla", bytes([0])) == 0  # still cached while free
    assert pool.allocate(2) == [3, 2]  # never-used block 3, then the least recently freed cached block
    assert pool.lookup("mla", bytes([2])) is None and pool.stats.evicted == 1
    pool.touch([0])  # a hit revives a free cached block: it leaves the free queue
    assert pool.allocate(1) == [1]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.check()


def test_double_free_and_caching_unreferenced_block_raise():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(RuntimeError, match="not referenced"):
        pool.cache("mla", b, b"x")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_second_turn_reuses_the_first_turns_blocks_and_salts_isolate_users():
    bs = 4
    m = KVCacheManager(64, bs)
    turn1 = list(range(10))
    assert m.admit("u1-t1", turn1, ["alice"]) == 0
    m.allocate("u1-t1", len(turn1) + 3)  # prompt + 3 generated tokens
    out = turn1 + [100, 101, 102]
    m.cache_full_blocks("u1-t1", out, len(out), ["alice"])
    m.free("u1-t1")
    turn2 = out + [7, 8, 9, 10, 11]
    hit = m.admit("u1-t2", turn2, ["alice"])
    assert hit == 12 and len(turn2) - hit <= 5 + bs - 1  # only the new tokens (+ < one block) remain
    assert m.admit("u2-t2", turn2, ["bob"]) == 0  # another user's salt shares nothing
    m.check()


def test_hit_needs_every_group_and_leaves_one_token_to_compute():
    m = KVCacheManager(16, 2, groups=("mla", "indexer"))
    m.admit("a", [1, 2, 3, 4])
    m.allocate("a", 4)
    m.cache_full_blocks("a", [1, 2, 3, 4], 4)
    assert m.admit("b", [1, 2, 3, 4]) == 2  # the last block is recomputed to produce logits
    assert m.admit("c", [1, 2, 3, 4, 5]) == 4
    m.pool.reset_prefix_cache()
    assert m.admit("d", [1, 2, 3, 4, 5]) == 0
    m.check()


def test_allocation_is_all_or_nothing():
    m = KVCacheManager(5, 2, groups=("mla", "indexer"))
    m.admit("a", [1])
    m.allocate("a", 4)  # 2 blocks x 2 groups
    m.admit("b", [1])
    assert not m.can_allocate("b", 3)
    with pytest.raises(NoFreeBlocks):
        m.allocate("b", 3)
    assert m.num_free_blocks == 1 and m.block_table("b", "mla") == []
    m.check()


class ManagerMachine(RuleBasedStateMachine):
    """Random admits (with shared prefixes and salts), growth, caching and frees; invariants after each."""

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(12, 2, groups=("mla", "indexer"))
        self.tokens: dict[str, list[int]] = {}
        self.given: dict[str, tuple[list[int], str]] = {}  # given back, waiting to be admitted again
        self.n = 0

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 7), salt=st.sampled_from(["a", "b"]))
    def admit(self, prefix, length, salt):
        rid = f"r{self.n}"
        self.n += 1
        toks = [prefix] * 3 + list(range(length))
        hit = self.m.admit(rid, toks, [salt])
        assert hit % 2 == 0 and hit < len(toks)
        self.tokens[rid] = (toks, salt, hit)
        try:
            self.m.allocate(rid, len(toks))
        except NoFreeBlocks:
            self.m.free(rid)
            del self.tokens[rid]
            return
        self.m.cache_full_blocks(rid, toks, len(toks), [salt])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 4))
    def grow(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks, salt, hit = self.tokens[rid]
        new = toks + [99] * extra
        if self.m.can_allocate(rid, len(new)):
            self.m.allocate(rid, len(new))
            self.m.cache_full_blocks(rid, new, len(new), [salt])
            self.tokens[rid] = (new, salt, hit)
        else:
            with pytest.raises(NoFreeBlocks):
                self.m.allocate(rid, len(new))

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 7), salt=st.sampled_from(["a", "b"]))
    def admit_and_give_back(self, prefix, length, salt):
        """An admission made with take=False and given back leaves the pool as taking its hit and freeing
        it (keep_hashes) does, and `free_in_tables` counts the free blocks the take uses up. (Not for ARC:
        its touches move blocks within T1 / T2 in take's order; a manager's pool is a plain BlockPool.)"""
        if isinstance(self.m.pool, ARCBlockPool):
            return
        rid = f"r{self.n}"
        self.n += 1
        toks = [prefix] * 3 + list(range(length))
        full = copy.deepcopy(self.m)
        assert self.m.admit(rid, toks, [salt], take=False) == full.admit(rid, toks, [salt])
        assert self.m.num_free_blocks - self.m.free_in_tables(rid) == full.num_free_blocks
        self.m.give_back(rid)
        full.free(rid, keep_hashes=True)
        assert self.m.pool.state() == full.pool.state() and self.m._kept_hashes == full._kept_hashes
        self.given[rid] = (toks, salt)

    @precondition(lambda self: self.given)
    @rule(data=st.data(), give_back=st.booleans())
    def admit_again(self, data, give_back):
        """A given-back request admitted again walks its prefix from its memo (`PrefixWalk`) where the pool
        changed no index entry of its hashes since: it finds what a fresh walk finds, after other requests'
        admissions, growth, caching, frees and resets that did and did not touch its pages (on a small
        index log, trimmed past older memos too)."""
        rid = data.draw(st.sampled_from(sorted(self.given)))
        toks, salt = self.given[rid]
        fresh = copy.deepcopy(self.m)
        fresh._walks.clear()
        assert rid in self.m._walks
        assert self.m.admit(rid, toks, [salt], take=False) == fresh.admit(rid, toks, [salt], take=False)
        assert self.m.requests[rid].tables == fresh.requests[rid].tables
        if give_back:
            self.m.give_back(rid)
            fresh.give_back(rid)
            assert self.m.pool.state() == fresh.pool.state() and self.m._kept_hashes == fresh._kept_hashes
            return
        self.m.take(rid)  # in: it runs like any admitted request
        del self.given[rid]
        try:
            self.m.allocate(rid, len(toks))
        except NoFreeBlocks:
            self.m.free(rid)
            return
        assert self.m.requests[rid].walk is None
        self.tokens[rid] = (toks, salt, 0)
        self.m.cache_full_blocks(rid, toks, len(toks), [salt])

    @rule()
    def reset_prefix_cache(self):
        self.m.pool.reset_prefix_cache()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(rid)
        del self.tokens[rid]

    @invariant()
    def pool_is_consistent(self):
        self.m.check()
        # a block referenced by a running request is never in the free queue, so never handed out
        held = {b for rid in self.tokens for g in self.m.groups for b in self.m.block_table(rid, g)}
        assert not held & set(self.m.pool.free_queue)
        assert len(held) + self.m.num_free_blocks == self.m.pool.num_blocks  # no leak

    def teardown(self):
        for rid in list(self.tokens):
            self.m.free(rid)
        for rid in self.given:
            self.m.drop_kept_hashes(rid)
        assert self.m.num_free_blocks == self.m.pool.num_blocks and not self.m._walks


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class LargeIndexPagesMachine(ManagerMachine):
    """The same operations with indexer pages of 2 hash chunks (index_block_size = 2 x block_size)."""

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(12, 2, groups=("mla", "indexer"), group_tokens_per_block={"indexer": 4})


TestLargeIndexPagesMachine = LargeIndexPagesMachine.TestCase
TestLargeIndexPagesMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


class ShortIndexLogMachine(LargeIndexPagesMachine):
    """The same operations with an index log of 3 changes: walk memos older than it are walked again."""

    def __init__(self):
        super().__init__()
        self.m.pool.index_log_max = 3


TestShortIndexLogMachine = ShortIndexLogMachine.TestCase
TestShortIndexLogMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_index_changes_and_walk_memos():
    """A pool logs the hashes whose index entry changes (`index_changes`), back to `index_log_max` changes
    and never across a reset; a PrefixWalk memo is used while none of its hashes changed, walked again
    otherwise, and checked against a fresh walk under verify."""
    from kvcache.block_pool import PrefixWalk

    pool = BlockPool(4)
    pool.index_log_max = 3
    e0 = pool.index_epoch
    a = pool.allocate(2)
    pool.cache("mla", a[0], b"A")
    pool.cache("mla", a[1], b"B")
    assert pool.index_changes(e0) == [b"A", b"B"] and pool.index_changes(pool.index_epoch) == []
    pool.free(a)
    walk, calls = PrefixWalk([b"A", b"C"]), []

    def lookup():
        calls.append(1)
        return [pool.lookup("mla", b"A"), pool.lookup("mla", b"C")]

    assert walk.memo("w", (), (pool,), lookup) == [a[0], None] and len(calls) == 1
    e1 = pool.index_epoch
    pool.allocate(1)  # hands out block 2 or 3 (never cached): no index change
    c = pool.allocate(1)[0]
    pool.cache("mla", c, b"D")  # a hash the walk did not look up
    assert walk.memo("w", (), (pool,), lookup) == [a[0], None] and len(calls) == 1
    with pytest.raises(AssertionError, match="differs"):  # verify walks again and compares
        walk.memo("w", (), (pool,), lambda: [None, None], verify=True)
    pool.free([c])
    pool.allocate(3)  # reuses the cached blocks: drops A, B and D
    assert pool.index_changes(e1) is None  # trimmed (4 changes since e1 on a log of 3)
    assert walk.memo("w", (), (pool,), lookup) == [None, None] and len(calls) == 2
    assert walk.memo("w", (1,), (pool,), lookup) == [None, None] and len(calls) == 3  # other args: walked
    e2 = pool.index_epoch
    pool.reset_prefix_cache()
    assert pool.index_changes(e2) is None and pool.index_changes(pool.index_epoch) == []


def test_larger_indexer_pages_cost_fewer_blocks_and_align_prefix_hits():
    m = KVCacheManager(64, 2, groups=("mla", "indexer"), group_tokens_per_block={"indexer": 6})
    assert m.blocks_needed_all(13) == 7 + 3 and m.hit_multiple == 3
    toks = list(range(13))
    m.admit("a", toks)
    m.allocate("a", 13)
    assert [len(m.block_table("a", g)) for g in m.groups] == [7, 3]
    m.cache_full_blocks("a", toks, 13)
    # 6 full chunks of 2 tokens = 2 full indexer pages; a hit ends on an indexer page boundary
    assert m.admit("b", toks + [50]) == 12
    assert m.admit("c", toks[:11]) == 6  # 5 chunks are cached but only 3 make a whole indexer page
    assert m.block_table("c", "indexer") == m.block_table("a", "indexer")[:1]
    m.check()
    with pytest.raises(ValueError, match="multiple of 2"):
        KVCacheManager(8, 2, group_tokens_per_block={"indexer": 3})


class ARCManagerMachine(ManagerMachine):
    """The same operations over an ARC-ordered pool (kvcache.block_pool.ARCBlockPool): its T1 / T2 / ghost
    invariants hold alongside the pool's."""

    def __init__(self):
        super().__init__()
        self.m.pool = ARCBlockPool(12)


TestARCManagerMachine = ARCManagerMachine.TestCase
TestARCManagerMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def _store(pool, key):
    """What the offload tier does to store a page: take a block, key it, leave it cached and unreferenced."""
    b = pool.allocate(1)[0]
    pool.cache("mla", b, key)
    pool.free([b])
    return b


def _hit(pool, key):
    b = pool.lookup("mla", key)
    pool.touch([b])
    pool.free([b])


@pytest.mark.parametrize("arc", [False, True])
def test_arc_keeps_a_reused_page_through_a_scan_where_lru_loses_it(arc):
    pool = ARCBlockPool(4) if arc else BlockPool(4)
    for k in (b"A", b"B"):
        _store(pool, k)
    _hit(pool, b"A")  # A is used again
    for i in range(8):  # a scan of one-time pages, twice the pool
        _store(pool, b"scan%d" % i)
    assert (pool.lookup("mla", b"A") is not None) == arc
    assert pool.lookup("mla", b"B") is None
    pool.check()


def test_arc_adapts_its_target_on_ghost_hits():
    pool = ARCBlockPool(3)
    for k in (b"A", b"B"):
        _store(pool, k)
    _hit(pool, b"B")  # B moves to T2
    for k in (b"C", b"D"):  # D evicts A (T1's least recent): A becomes a ghost in B1
        _store(pool, k)
    assert pool.lookup("mla", b"A") is None and ("mla", b"A") in pool.b1 and pool.p == 0
    _store(pool, b"A")  # a store of a B1 ghost: T1 was too small, p grows, A joins T2 (C makes room)
    assert pool.p == 1 and [pool.block_key[b][1] for b in pool.t2] == [b"B", b"A"]
    assert ("mla", b"C") in pool.b1 and pool.lookup("mla", b"D") is not None
    pool.check()
    # a pinned block is never reused, whichever list it is in
    pool.touch([pool.lookup("mla", b"A")])
    for i in range(5):
        _store(pool, b"x%d" % i)
    assert pool.lookup("mla", b"A") is not None
    pool.check()


@pytest.mark.parametrize("arc", [False, True])
@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_a_list_frees_and_touches_as_one_call_per_block(arc, order, rnd):
    """free(blocks) and touch(blocks) leave the pool as free([b]) / touch([b]) for each b in order would,
    a block listed twice included (HostTier.release and its pinning batch a request's pages per pool)."""
    def pools():
        made = []
        for _ in range(2):
            pool = ARCBlockPool(6) if arc else BlockPool(6)
            blocks = pool.allocate(6)
            for b in blocks[:3]:
                pool.cache("mla", b, b"h%d" % b)
            pool.touch(blocks)  # every block referenced twice, so any list of up to two mentions frees
            made.append(pool)
        return made

    order = [b for b in order if order.count(b) <= 2]
    one, each = pools()
    one.free(order)
    for b in order:
        each.free([b])
    assert one.state() == each.state() and list(one.free_queue) == list(each.free_queue)
    if arc:
        assert list(one._blank) == list(each._blank)
    free = [b for b in rnd.sample(order, len(order)) if one.ref_count[b] == 0]
    one.touch(free + free[:1])
    for b in free + free[:1]:
        each.touch([b])
    assert one.state() == each.state() and list(one.free_queue) == list(each.free_queue)


@pytest.mark.parametrize("arc", [False, True])
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5)), max_size=14))
@settings(max_examples=60, deadline=None)
def test_cache_all_is_cache_one_page_at_a_time(arc, pages):
    """cache_all(g, blocks, hashes) leaves the pool (index, its change log and its trims, version) as
    cache(g, b, h) for each pair in order would: a block cached twice, a hash another block holds."""
    def pool():
        p = ARCBlockPool(8) if arc else BlockPool(8)
        p.index_log_max = 3  # trimmed inside the call
        p.allocate(8)
        return p

    one, each = pool(), pool()
    one.cache_all("mla", [b for b, _ in pages], [b"h%d" % h for _, h in pages])
    for b, h in pages:
        each.cache("mla", b, b"h%d" % h)
    assert one.state() == each.state() and one.cached == each.cached
    assert (one._index_log, one._index_base, one.version) == (each._index_log, each._index_base, each.version)
    with pytest.raises(RuntimeError, match="not referenced"):
        blank = BlockPool(2)
        blank.cache_all("mla", [0], [b"h"])
