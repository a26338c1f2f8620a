"""`python -m tests.glm53.faulty_serve ARGS`: `python -m glm53.serve ARGS` whose model runner raises while
sampling any step that samples a prompt beginning with FAULT_PROMPT, after that step's forward ran and
wrote its KV (as a sampling parameter the sampler's arrays cannot hold would fail there). Every other request is served as by glm53.serve, so one server process serves a test module's ordinary
requests and its failure injection."""

import sys

from glm53 import serve
from glm53.engine.runner import ModelRunner

FAULT_PROMPT = [509, 7, 509, 7, 509, 7, 509, 7]
_pick = ModelRunner._pick


def _faulty_pick(self, logits_RV, rows, idx):
    n = len(FAULT_PROMPT)
    if any(r.start == 0 and r.token_ids[:n].tolist() == FAULT_PROMPT for r in rows):
        raise OverflowError("injected: a sampling parameter the sampler's arrays cannot hold")
    return _pick(self, logits_RV, rows, idx)


if __name__ == "__main__":
    ModelRunner._pick = _faulty_pick
    serve.main(sys.argv[1:])
