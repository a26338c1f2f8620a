"""What keeping a checkpoint's fp8 block-quantised weights in fp8 costs in accuracy and saves in memory.

    python -m experiments.fp8_weights --out results/fp8_weights

1. One product (attention/fp8_matmul.py): x [256, 2048] @ w [2048, 1024], both standard normal, w
   quantised in 128 x 128 blocks, x per token and group of 128: relative RMS and max error against
   float32 math with the original and with the dequantised weight, and the largest ratio of the error to
   the derived elementwise bound.
2. The tiny fp8 fixture (tests/fixtures/make_fp8_fixture.py: glm53.init("tiny", seed=0, std=0.1)
   quantised) loaded three ways: quantization="fp8" (fp8 in memory, fp8 activations), quantization=None
   (the same weights dequantised to float32), and the float32 model it was quantised from. Per prompt
   length (random tokens, seed 0): `max_abs_err_rel` = max |logit - reference| / max |reference|,
   `rel_rms` = RMS(logit - reference) / RMS(reference), `top1_agreement`; for fp8 vs dequantised (the
   activation rounding alone), dequantised vs float (the weight rounding alone), and, as a yardstick,
   the dequantised model with bfloat16 activations vs float32. Prompts up to index_topk (16) tokens run
   dense attention; longer ones select rows, where a perturbed index score can flip a selection.
3. Greedy continuations (16 tokens after a 40-token prompt) of the three models, and how many agree.
4. Memory: the fixture's quantised layers in fp8 vs float32, and GLM-5.3's (from the model definition,
   nothing allocated): the layers an fp8 checkpoint quantises, in bfloat16 vs fp8 + scales, and its
   routed experts per GPU at EP8.
Writes OUT/results.json. Asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import glm53
from attention import fp8_matmul
from experiments.bench_model import REPO, run_metadata
from glm53 import fp8
from glm53.layers import Experts
from glm53.weights import abstract_model

LENGTHS = (8, 16, 40, 64)


def _compare(got, want) -> dict:
    return {"max_abs_err_rel": float(np.abs(got - want).max() / np.abs(want).max()),
            "rel_rms": float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())),
            "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).mean())}


def one_product(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, 2048)).astype(np.float32)
    w = rng.standard_normal((2048, 1024)).astype(np.float32)
    b = fp8_matmul.quantize_blocks(w)
    w_hat = np.asarray(b.dequantize(), np.float64)
    y = np.asarray(fp8_matmul.matmul(x, b), np.float64)
    x64 = x.astype(np.float64)
    exact, exact_deq = x64 @ w.astype(np.float64), x64 @ w_hat
    xs = np.repeat(np.abs(x64).reshape(256, 16, 128).max(-1) / 448, 128, 1)  # amax > 1e-4 here
    bound = (2.0 ** -4 * np.abs(x64) + 2.0 ** -10 * xs) @ np.abs(w_hat)
    rms = lambda e, r: float(np.sqrt((e ** 2).mean() / (r ** 2).mean()))  # noqa: E731
    return {"shape": "x [256, 2048] @ w [2048, 1024], standard normal",
            "vs_float32_weight": {"rel_rms": rms(y - exact, exact),
                                  "max_abs_err_rel": float(np.abs(y - exact).max() / np.abs(exact).max())},
            "vs_dequantised_weight": {"rel_rms": rms(y - exact_deq, exact_deq),
                                      "max_abs_err_rel": float(np.abs(y - exact_deq).max() / np.abs(exact_deq).max()),
                                      "max_err_over_bound": float((np.abs(y - exact_deq) / bound).max())}}


def _fixture(out: Path):
    spec = importlib.util.spec_from_file_location("make_fp8_fixture", REPO / "tests" / "fixtures" / "make_fp8_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    float_model = glm53.init("tiny", seed=0, std=0.1)
    module.write(out, model=float_model)
    return float_model


def tiny_fixture() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "tiny-fp8"
        float_model = _fixture(ckpt)
        models = {"fp8": glm53.from_pretrained(ckpt, quantization="fp8"),
                  "dequantised": glm53.from_pretrained(ckpt),
                  "dequantised_bf16": glm53.from_pretrained(ckpt, dtype="bfloat16"),
                  "float": float_model}
    rng = np.random.default_rng(0)
    rows = []
    for n in LENGTHS:
        ids = rng.integers(0, 512, n)
        s = {k: glm53.score(m, ids) for k, m in models.items()}
        row = {"prompt_tokens": n, "dense_attention": n <= models["fp8"].cfg.index_topk,
               "fp8_vs_dequantised": _compare(s["fp8"], s["dequantised"]),
               "dequantised_vs_float": _compare(s["dequantised"], s["float"]),
               "fp8_vs_float": _compare(s["fp8"], s["float"]),
               "bf16_activations_vs_float32": _compare(s["dequantised_bf16"], s["dequantised"])}
        rows.append(row)
        print(f"{n:3d} tokens: fp8 vs dequantised {row['fp8_vs_dequantised']}", flush=True)
    prompt = np.random.default_rng(0).integers(0, 512, 40)
    greedy = {k: glm53.generate(models[k], prompt, 16).token_ids.tolist() for k in ("fp8", "dequantised", "float")}
    agree = lambda a, b: sum(x == y for x, y in zip(greedy[a], greedy[b]))  # noqa: E731
    first = lambda a, b: next((i for i, (x, y) in enumerate(zip(greedy[a], greedy[b])) if x != y), None)  # noqa: E731
    bytes_ = {"fp8_model": fp8.weight_bytes(models["fp8"]), "dequantised_model": fp8.weight_bytes(models["dequantised"])}
    return {"logits": rows,
            "greedy": {"prompt": "40 random tokens (numpy default_rng(0).integers(0, 512, 40))", "new_tokens": 16,
                       "tokens": greedy,
                       "fp8_vs_dequantised_agree": agree("fp8", "dequantised"),
                       "fp8_vs_dequantised_first_difference": first("fp8", "dequantised"),
                       "dequantised_vs_float_agree": agree("dequantised", "float"),
                       "fp8_vs_float_agree": agree("fp8", "float")},
            "weight_bytes": bytes_}


def glm53_memory(ep: int = 8) -> dict:
    """Bytes of the layers GLM-5.3's fp8 checkpoint quantises, from the model's shapes."""
    cfg = glm53.get_preset("glm-5.3")
    model = abstract_model(cfg)
    modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
    values = blocks = expert_values = expert_blocks = 0
    for path in fp8.eligible_modules(model):
        m = modules[path]
        if isinstance(m, Experts):
            e, d, f2 = m.gate_up_proj.shape
            mats = [(d, f2 // 2)] * 2 * e + [(f2 // 2, d)] * e
        else:
            mats = [m.weight.shape]
        n = sum(a * b for a, b in mats)
        nb = sum(math.ceil(a / 128) * math.ceil(b / 128) for a, b in mats)
        values, blocks = values + n, blocks + nb
        if isinstance(m, Experts):
            expert_values, expert_blocks = expert_values + n, expert_blocks + nb
    gib = 2.0 ** 30
    return {"quantised_params": values, "scale_blocks": blocks,
            "quantised_bf16_GiB": 2 * values / gib, "quantised_fp8_GiB": (values + 4 * blocks) / gib,
            "routed_experts_params": expert_values,
            f"routed_experts_per_gpu_ep{ep}_bf16_GiB": 2 * expert_values / ep / gib,
            f"routed_experts_per_gpu_ep{ep}_fp8_GiB": (expert_values + 4 * expert_blocks) / ep / gib}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {**run_metadata("fp8_weights"), "what": __doc__.split("\n\n")[0].strip(),
               "one_product": one_product(), "tiny_fixture": tiny_fixture(), "glm53_memory": glm53_memory()}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: results[k] for k in ("one_product", "glm53_memory")}, indent=1))
    print(json.dumps(results["tiny_fixture"]["greedy"], indent=1))
    print(f"wrote {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
