"""`python -m tests.glm53.faulty_serve ARGS`: `python -m glm53.serve ARGS` whose model runner raises while
sampling any step that samples a prompt beginning with FAULT_PROMPT, after that step's forward ran and
wrote its KV (as a sampling parameter the sampler's arrays cannot hold would fail there), and sleeps
SLOW_S before sampling any step with a row of a request whose seed is SLOW_SEED (a step as long as a
compilation, holding the engine thread). Every other request is served as by glm53.serve, so one server
process serves a test module's ordinary requests and its failure injection."""

import sys
import time

from glm53 import serve
from glm53.engine.runner import ModelRunner

FAULT_PROMPT = [509, 7, 509, 7, 509, 7, 509, 7]
SLOW_SEED = 515151
SLOW_S = 6.0
_pick = ModelRunner._pick


def _faulty_pick(self, logits_RV, rows, idx):
    if any(r.params.seed == SLOW_SEED for r in rows):
        time.sleep(SLOW_S)
    n = len(FAULT_PROMPT)
    if any(r.start == 0 and r.token_ids[:n].tolist() == FAULT_PROMPT for r in rows):
        raise OverflowError("injected: a sampling parameter the sampler's arrays cannot hold")
    return _pick(self, logits_RV, rows, idx)


if __name__ == "__main__":
    ModelRunner._pick = _faulty_pick
    serve.main(sys.argv[1:])
