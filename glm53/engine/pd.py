"""The P/D connector's queries of an engine (glm53.engine.engine.Engine inherits them): a producer's chunk
keys of a finished request's prompt, a consumer's check of the page spans its producer announced, and
the peer tier's counters. They read the engine's configuration, its fingerprint and finished requests
(`fingerprint`, `_weights_sample`, `_spans`, `kv_transfer_failed_lookups`, `finished`, `_owner`,
`replicas`, `tiers`, set by Engine.__init__), so a server thread may call the prompt queries."""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator

from glm53.engine.build import kv_fingerprint, kv_row_bytes
from glm53.engine.config import GROUPS, PD_TIER
from kvcache.block_pool import block_hashes
from kvcache.tiers import PageSpans, chunk_key, make_tier, read_page_tokens, tail_chunk
from kvcache.tiers.remote import RelayoutTier

CHUNK_KEYS_MEMO = 256  # salts whose last prompt's chunk keys `chunk_keys` keeps (per engine) ...
# ... and the hash blocks they hold at most (about 300 bytes each: 1 << 19 is c32 of 1M-token contexts)
CHUNK_KEYS_MEMO_BLOCKS = 1 << 19


class PdQueries:
    """The P/D producer and consumer queries of an Engine (a mixin of it)."""

    def pd_tier(self, replica: int):
        """The PdConnector's peer tier of `replica` (kvcache.tiers.p2p.PeerTier), None without the connector."""
        tiers = self.tiers[replica] if self.deploy.kv_role is not None else None
        return next((t for t in tiers.tiers if t.name == PD_TIER), None) if tiers is not None else None

    def page_spans(self, page_tokens: dict[str, int] | None = None) -> PageSpans:
        """How this engine's chunks cut a request (kvcache.tiers.PageSpans), or, with `page_tokens` (tokens
        per page per cache group, multiples of this engine's hash block), how an engine of this model,
        weights and KV dtype would cut it with those pages: the fingerprint a P/D producer of those spans
        must announce."""
        d = self.deploy
        own = d.group_tokens_per_block(GROUPS)
        tokens = dict(own) if page_tokens is None else {g: page_tokens[g] for g in GROUPS}
        at = tuple(tokens.items())
        if at not in self._spans:
            # a page's bytes are its tokens' (the same row bytes whatever the span: the canonical layout)
            pages = {g: self.sizes.page_bytes[g] // own[g] * tokens[g] for g in GROUPS}
            fp = (self.fingerprint if tokens == own else
                  kv_fingerprint(self.cfg, d, self.sizes, page_tokens=tokens, page_bytes=pages,
                                 weights=self._weights_sample))
            hash_block = tokens["mla"]  # block_size x DCP: the MLA page is one hash block
            if len(self._spans) >= 64:  # requests name the spans: bounded, whatever they send
                self._spans.clear()
            self._spans[at] = PageSpans(fp, hash_block, at)
        return self._spans[at]

    def remote_source(self, announced: PageSpans | None) -> PageSpans | None:
        """What a P/D consumer's request takes its prompt's KV by, given the spans its producer announced
        (kv_transfer_params' remote_page_spans; None: not announced, the same as ours): None when they are
        ours (our own keys name the producer's chunks), the producer's spans when only the spans differ
        (kvcache.tiers.remote.RelayoutTier assembles our pages from its chunks). ValueError, naming both
        sides' spans, for a producer whose chunks cannot be ours whatever their span: another model,
        weights or KV format, or MTP on one side only (the fingerprint it announced is not the one this
        engine computes for its spans)."""
        if announced is None:
            return None
        tokens = dict(announced.page_tokens)
        # ours hash blocks of block_size x DCP tokens, the MLA page; other groups' pages are multiples of it
        ok = set(tokens) == set(GROUPS) and announced.hash_block_tokens == tokens["mla"]
        want = self.page_spans(tokens) if ok else None
        if want is None or want.fingerprint != announced.fingerprint:
            raise ValueError(f"the producer's chunks ({announced.describe()}, fingerprint {announced.fingerprint[:16]}) "
                             f"cannot be this engine's ({self.page_spans().describe()}): another model, weights or "
                             "KV format, or MTP on one side only")
        return None if want.fingerprint == self.fingerprint else want

    def _wrap(self, tier, spec: dict | None = None, replica: int = 0):
        """A tier seen through RelayoutTier where our pages may come from chunks of other spans: the
        PdConnector's peer tier of a consumer (pages of any producer's spans), and a tier whose `spec`
        lists other writers' spans (`read_page_tokens`: each becomes the PageSpans an engine of this
        model, weights and KV dtype with those pages writes, `page_spans`, read through a second tier of
        `spec` under that fingerprint, which never evicts); any other tier as it is."""
        also = []
        for i, tokens in enumerate(read_page_tokens(spec or {})):
            if set(tokens) != set(GROUPS):
                raise ValueError(f"secondary tier {tier.name!r}: read_page_tokens[{i}] must give the tokens per page "
                                 f"of every cache group {list(GROUPS)}, got {tokens!r}")
            try:
                spans = self.page_spans(tokens)
            except ValueError as e:  # spans no engine of this model can have (PageSpans' own check)
                raise ValueError(f"secondary tier {tier.name!r}: read_page_tokens[{i}]={tokens!r}: {e}") from None
            if spans.fingerprint == self.fingerprint:  # our own spans: the tier itself reads them
                continue
            reader = {**spec, "max_bytes": None} if spec["type"] in ("fs", "obj") else spec
            also.append((spans, make_tier(reader, spans.fingerprint, replica=replica)))
        pd = tier.name == PD_TIER and self.deploy.kv_role in ("kv_consumer", "kv_both")
        if not pd and not also:
            return tier
        return RelayoutTier(tier, self.page_spans(), kv_row_bytes(self.cfg, self.deploy, self.sizes),
                            also=tuple(also))

    def kv_transfer_failed(self, replica: int) -> int:
        """P/D requests of `replica` that got nothing from their producer for a reason other than its never
        having prefilled them (glm53:kv_transfer_failed_lookups): its chunks cannot be ours
        (`remote_source`), or it did not answer the lookup (not up, past its deadline, skipped after
        missing one: the "pd" tier's `named_peer_failures`). Each is logged once per producer."""
        tier = self.pd_tier(replica)
        return self.kv_transfer_failed_lookups[replica] + getattr(getattr(tier, "stats", None), "named_peer_failures", 0)

    def kv_transfer_received_tokens(self, replica: int) -> int:
        """Prompt tokens whose KV `replica` loaded from a P/D producer: the MLA pages the PdConnector's tier
        loaded (every page has one) times their tokens (glm53:kv_transfer_received_tokens)."""
        pages = self.replicas[replica].scheduler.policy.host_tier.loaded_pages[(PD_TIER, "mla")]
        return pages * self.deploy.group_tokens_per_block(("mla",))["mla"]

    def prompt_chunk_keys(self, req_id: str) -> tuple[int, list[list[tuple[str, bytes]]]]:
        """A finished request's prompt as its consumer's prefix lookup will ask for it (P/D producer):
        (tokens per hash block, per full hash block of all but the prompt's last token, (group, chunk key)
        (kvcache.tiers.chunk_key) of the host-tier pages ending there, one per cache group). Reads only
        the finished request and the configuration (and `chunk_keys`' memo, whose updates a concurrent
        caller tolerates), so a server thread may call it."""
        req = self.finished[req_id]
        return self.chunk_keys(req.prompt_ids, req.extra_keys, upto=req.prompt_ids.size - 1,
                               replica=self._owner[req_id])

    def prompt_tail_keys(self, req_id: str) -> tuple[int, list[tuple[str, bytes]]]:
        """A finished P/D prefill leg's tail chunks (kvcache.tiers.tail_chunk: what its finish stored of its
        prompt's last partial pages, HostTier.store_tail): (the leading tokens they end at, all but the
        prompt's last, and per cache group with a host pool whose page there is partial, (group, key)).
        Reads only the finished request and the configuration, so a server thread may call it."""
        req = self.finished[req_id]
        kv = self.replicas[self._owner[req_id]].scheduler.kv
        pools = self.replicas[self._owner[req_id]].scheduler.policy.host_tier.pools
        n = req.prompt_ids.size - 1
        hashes = block_hashes(req.prompt_ids, kv.tokens_per_block, req.extra_keys, upto=n)
        tails = [(g, tail_chunk(self.fingerprint, g, kv.group_tokens_per_block[g], kv.tokens_per_block,
                                req.prompt_ids, req.extra_keys, n, hashes)) for g in kv.groups if g in pools]
        return n, [(g, t[1]) for g, t in tails if t is not None]

    def chunk_keys(self, token_ids, extra_keys, *, upto: int, replica: int = 0
                   ) -> tuple[int, list[list[tuple[str, bytes]]]]:
        """This engine's chunks of the first `upto` tokens of `token_ids` hashed with `extra_keys` (the salt):
        (tokens per hash block, per full hash block, (group, chunk key) of the host-tier pages ending
        there, one per cache group that has a host pool). The per-block lists are shared with the memo
        of the salt's last prompt (and earlier answers): callers read them only."""
        sch = self.replicas[replica].scheduler
        kv, pools = sch.kv, sch.policy.host_tier.pools
        hashes = block_hashes(token_ids, kv.tokens_per_block, extra_keys, upto=upto)
        # a session's next prompt shares its leading blocks with the last one keyed under its salt: those
        # blocks' keys are taken from it (a C-level compare of the hashes, mostly the same bytes objects)
        memo, at = self.__dict__.setdefault("_chunk_keys_memo", {}), (replica, tuple(extra_keys))
        last_hashes, last = memo.get(at, ((), []))
        same = next(itertools.compress(itertools.count(), map(operator.ne, last_hashes, hashes)),
                    min(len(last_hashes), len(hashes)))
        out: list[list[tuple[str, bytes]]] = last[:same] + [[] for _ in range(same, len(hashes))]
        for g in kv.groups:  # group by group, so each block's list keeps kv.groups' order
            if g in pools:
                r = kv.ratio[g]
                c0 = same + (r - 1 - same) % r  # the first block from `same` on that ends a page of g
                keys = map(functools.partial(chunk_key, self.fingerprint, g), hashes[c0::r])
                for c, key in zip(range(c0, len(hashes), r), keys):
                    out[c].append((g, key))
        memo.pop(at, None)
        memo[at] = (hashes, out)
        # the salts keyed least recently go first, the newest stays (tolerant of a concurrent caller)
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):
            while len(memo) > 1 and (len(memo) > CHUNK_KEYS_MEMO
                                     or sum(len(h) for h, _ in memo.values()) > CHUNK_KEYS_MEMO_BLOCKS):
                memo.pop(next(iter(memo)), None)
        return kv.tokens_per_block, out
