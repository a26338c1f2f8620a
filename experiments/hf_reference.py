"""Time HF transformers' GlmMoeDsaForCausalLM on CPU (run under a Python with torch + transformers).

    python experiments/hf_reference.py --checkpoint DIR --lengths 1024 4096 --threads 2 [--decode-steps 16]

Prints progress lines, then one JSON object on the last line: {"prefill": [{"tokens", "seconds"}],
"decode_ms_per_step", "torch", "transformers", "threads"}. Used by experiments/bench_model.py, which runs it
in a subprocess, so this file imports no JAX and none of our packages. Prefill = one forward of the whole
prompt without cache (eager attention, float32, no grad), best of --repeats, after one warm-up forward of
the shortest length (eager PyTorch compiles nothing; the warm-up only settles allocator and threads);
decode = greedy steps with HF's cache after a prompt of the first length, after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    torch.set_num_threads(args.threads)
    model = GlmMoeDsaForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads, "prefill": []}
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
