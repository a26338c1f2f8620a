"""Time HF transformers' GlmMoeDsaForCausalLM on CPU (run under a Python with torch + transformers).

    python experiments/hf_reference.py --checkpoint DIR --lengths 1024 4096 --threads 2 [--decode-steps 16]

Prints progress lines, then one JSON object on the last line: {"prefill": [{"tokens", "seconds"}],
"decode_ms_per_step", "torch", "transformers", "threads"}. Used by experiments/bench_model.py, which runs it
in a subprocess, so this file imports no JAX and none of our packages. Prefill = one forward of the whole
prompt without cache (--attn attention: "sdpa", HF's default for this model, or "eager"; float32, no grad), best of --repeats, after one warm-up forward of
the shortest length (eager PyTorch compiles nothing; the warm-up only settles allocator and threads);
decode = greedy steps with HF's cache after a prompt of the first length, after one warm-up step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

# HF's attention implementations that run this model on CPU: "sdpa" (torch's scaled_dot_product_attention
# with the DSA mask; HF's default for GlmMoeDsa) and "eager" (explicit softmax; what the parity fixtures use)
HF_ATTN_CHOICES = ("sdpa", "eager")


@contextlib.contextmanager
def stable_indexer_topk():
    """Inside this block HF's lightning indexer picks its top-k in our total order (score descending,
    then position ascending) instead of `torch.topk`'s unspecified order among ties. Ties are common
    with random weights: a key scores exactly 0 whenever ReLU zeroes every indexer head, and the k-th
    cut often falls inside that block of zeros, so the two libraries would attend different rows
    (docs/model.md). Only the indexer's call of `Tensor.topk` is changed; costs a full sort per row."""
    import torch
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_mod

    orig_topk, orig_forward = torch.Tensor.topk, hf_mod.GlmMoeDsaIndexer.forward

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch's signature)
        assert largest, "the indexer only asks for the largest scores"
        s = torch.sort(self, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((s.values.narrow(dim, 0, k), s.indices.narrow(dim, 0, k)))

    def forward(self, *args, **kwargs):
        torch.Tensor.topk = stable_topk
        try:
            return orig_forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = orig_topk

    hf_mod.GlmMoeDsaIndexer.forward = forward
    try:
        yield
    finally:
        hf_mod.GlmMoeDsaIndexer.forward = orig_forward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--attn", default="sdpa", choices=HF_ATTN_CHOICES)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    torch.set_num_threads(args.threads)
    model = GlmMoeDsaForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, attn_implementation=args.attn)
    model.eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads,
           "attn_implementation": args.attn, "prefill": []}
    with torch.no_grad():
        model(torch.randint(0, vocab, (1, min(args.lengths)), generator=gen), use_cache=False)  # warm-up
        for n in args.lengths:
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                model(ids, use_cache=False)
                times.append(time.perf_counter() - t0)
            out["prefill"].append({"tokens": n, "seconds": min(times)})
            print(json.dumps({"progress": n, "seconds": min(times)}), flush=True)
        if args.decode_steps:
            n = args.lengths[0]
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            res = model(ids, use_cache=True)
            cache, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
            res = model(tok, past_key_values=cache, use_cache=True)  # warm-up step
            cache, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                res = model(tok, past_key_values=cache, use_cache=True)
                cache, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
            out["decode_ms_per_step"] = (time.perf_counter() - t0) / args.decode_steps * 1e3
            out["decode_context_tokens"] = n
    print(json.dumps(out))


if __name__ == "__main__":
    main()
