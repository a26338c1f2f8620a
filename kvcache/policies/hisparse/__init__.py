"""kv_policy="hisparse": keep requests decoding with most of their MLA KV in a host pool (planner.py).
Its device half (the hot buffers and staging the model runner drives) is device.py."""

from kvcache.policies.hisparse.planner import (TAIL_PAGES, HiSparsePolicy, HiSparseRow, HiSparseStats, Residency,
                                              device_blocks_per_request, hot_buffer_rows)

__all__ = ["TAIL_PAGES", "HiSparsePolicy", "HiSparseRow", "HiSparseStats", "Residency", "device_blocks_per_request",
           "hot_buffer_rows"]
