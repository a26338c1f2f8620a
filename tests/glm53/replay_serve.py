"""`python -m tests.glm53.replay_serve ARGS`: `python -m glm53.serve ARGS` with no model: the engine's runner
(a SyntheticRunner) answers each request with the bytes of the last `<<say:TEXT:yas>>` in its prompt, one
byte token per step, then EOS_ID (the preset's byte tokenizer gets that end-of-sequence id), so a test
decides the model's output through the prompt it sends, and nothing compiles. Run it with
--no-enable-prefix-caching: the runner reads each prompt from its prefill rows, all of them."""

import re
import sys
import types

import glm53
import glm53.tokenizer
from glm53 import serve
from glm53.config import PRESETS
from glm53.engine.synthetic import SyntheticRunner

SAY = re.compile(rb"<<say:(.*?):yas>>", re.DOTALL)
EOS_ID = 511  # a token the tiny preset's vocabulary holds beyond the 256 bytes


def say(text: str) -> str:
    """The directive that makes the replayed model answer `text`."""
    return f"<<say:{text}:yas>>"


class ReplayRunner(SyntheticRunner):
    def __init__(self):
        super().__init__(token=self._next)
        self.prompts: dict[str, list[int]] = {}

    def _tokens(self, plan):
        for row in plan.rows:
            if row.num_generated == 0:  # a prefill chunk: the prompt, in order (no prefix cache)
                seen = self.prompts.setdefault(row.req_id, [])
                assert row.start == len(seen), "replay_serve needs --no-enable-prefix-caching"
                seen.extend(row.token_ids.tolist())
        return super()._tokens(plan)

    def _next(self, row) -> int:
        said = SAY.findall(bytes(t for t in self.prompts[row.req_id] if t < 256))
        script = said[-1] if said else b""
        return script[row.num_generated] if row.num_generated < len(script) else EOS_ID


def _engine(model, deploy):
    return _Engine(model.cfg, deploy, runner=ReplayRunner())


def _tokenizer(model, chat_template=None):
    tok = _load_tokenizer(model, chat_template)
    tok.eos_token_ids = (EOS_ID,)
    return tok


_Engine, _load_tokenizer = glm53.Engine, glm53.tokenizer.load_tokenizer

if __name__ == "__main__":
    glm53.init = lambda preset, seed=0, dtype=None: types.SimpleNamespace(cfg=PRESETS[preset]())
    glm53.Engine = _engine
    glm53.tokenizer.load_tokenizer = _tokenizer
    serve.main(sys.argv[1:])
