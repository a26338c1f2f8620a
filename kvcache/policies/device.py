"""The device half of a KV policy: the arrays and copies a policy needs at execute time, behind the one
small interface the model runner calls without knowing which policy it is.

The planner half (kvcache.policies.<name>) decides on block ids and records transfers; the device
half turns the plan's per-row policy data (`StepPlan.policy_rows`) into views a forward carries in the
paged cache, takes them back after the forward, and reports what they did. A policy with no device state
(preempt, offload) uses `DeviceHalf` itself: every hook is a no-op.

The runner's calls, in order:

    half.bind(host, table, index_groups=, ranks=)  # kvcache.host.HostMemory, table(group, rows, tables, window)
    half.verify_form(spec, platform)  # MTP's verify form under this policy
    cache = host.apply(plan.transfers, cache, others=half.transfer)  # per step: ops on the half's state
    views = half.group_views(rows, decode=, tables_mla=, padded=)   # per width group; None: plain
    cache = half.attach(cache, views(window, queries))              # per forward of the group
    cache = half.detach(cache)                                      # after it: the view's state back
    resolves, stages, h2d_bytes = half.take_records(req_ids)        # the group's counts, checked
    [(resolves, stages, h2d_bytes), ...] = half.take_rank_records(parts)  # DP x EP: per rank's rows

Under DP x EP one half serves every rank (`ranks` > 1): a rank's transfers run with `transfer(op, rank)`,
a group's rows are every rank's, rank-major, and its counts come back per rank.
    half.end_warmup(); half.warmup()        # forget warm-up's counts; compile its transfer programs

A half owns whatever device state its policy keeps besides the paged cache (HiSparse's hot buffers), and
runs the transfer operations on it; the host memory knows none of it. A policy's spec returns its half
(`kvcache.policies.base.Policy.device_half`); the runner asks `deploy.policy.device_half(...)`, never a
policy by name.
"""

from __future__ import annotations


class DeviceHalf:
    """A policy without device state: no views, no records, nothing extra to compile."""

    # whether `group_views` can return views (a layout whose forwards cannot carry views refuses the
    # policy before allocating anything)
    has_views = False

    def bind(self, host, table, *, index_groups: int, ranks: int = 1) -> None:
        """The replica's host memory, `table(group, rows, tables, window)`: a padded block table, and the
        model's IndexShare groups (len(cache.index)); `ranks`: the DP x EP ranks it serves (each its own
        planner, pool slice and host slice); a half with device state makes it here, per rank."""
        self.host = host

    def transfer(self, op, rank: int = 0) -> None:
        """Run rank `rank`'s plan's transfer operation that the host memory does not (one on this half's
        state)."""
        raise TypeError(f"not a transfer operation this KV policy runs: {op!r}")

    def verify_form(self, spec, platform: str) -> str:
        """The MTP verify form ("sequential" | "batched") of `spec` (glm53.engine.spec_decode) here."""
        return spec.verify_form(platform)

    def group_views(self, rows, *, decode: bool, tables_mla, padded: int):
        """For one width group (`rows`: its entries of plan.policy_rows, or None; `decode`: the decode or
        verify bucket; `tables_mla`: its rows' MLA block tables; `padded` rows): None (the plain forward),
        or views(window, queries=1) -> a view for each forward of the group."""
        return None

    def empty_views(self, padded: int, *, decode: bool):
        """`group_views` of padding rows only (warm-up compiles the programs a view adds), or None."""
        return None

    def attach(self, cache, view):
        """The paged cache carrying `view` (None: unchanged)."""
        return cache

    def detach(self, cache):
        """A forward's cache without its view; the view's state goes back to the host memory and its
        counts wait for `take_records`."""
        return cache

    def take_records(self, req_ids: tuple[str, ...]) -> tuple[tuple, tuple, int]:
        """The group's views since the last call -> (ResolveRecords, StageRecords, host->device bytes);
        raises if a view read fewer rows than selected."""
        return (), (), 0

    def take_rank_records(self, parts) -> list[tuple[tuple, tuple, int]]:
        """`take_records` per DP x EP rank: parts [(req_ids, the rank's first row in the group)] in rank
        order -> one (ResolveRecords, StageRecords, host->device bytes) per rank."""
        return [((), (), 0) for _ in parts]

    def warmup_blocks(self) -> dict[str, int]:
        """Per cache group, the pages of one request whose save / load programs warm-up compiles."""
        return {}

    def warmup(self) -> None:
        """Compile the programs of this half's own transfer operations."""

    def end_warmup(self) -> None:
        """Forget what warm-up's views counted."""


class SavedCopies(DeviceHalf):
    """Swap: no views; its save and load programs (kvcache.host.HostMemory) cover up to one request's
    pages per group, and warm-up compiles every padded count."""

    def __init__(self, blocks: dict[str, int]):
        self.blocks = dict(blocks)

    def warmup_blocks(self) -> dict[str, int]:
        return dict(self.blocks)
