"""kv_policy="hisparse": keep requests decoding with most of their MLA KV in a host pool. planner.py is the
planner, spec.py its sizes, checks, metrics and pricing; its device half (the hot buffers and staging the
model runner drives) is device.py."""

from kvcache.policies.hisparse.planner import HiSparsePolicy, HiSparseRow, HiSparseStats, Residency
from kvcache.policies.hisparse.spec import TAIL_PAGES, HiSparseSpec, device_blocks_per_request, hot_buffer_rows

__all__ = ["TAIL_PAGES", "HiSparsePolicy", "HiSparseRow", "HiSparseSpec", "HiSparseStats", "Residency",
           "device_blocks_per_request", "hot_buffer_rows"]
