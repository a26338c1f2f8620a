"""The servers' model: tests/models.py's `serving_model`, and its checkpoint, which every test server of
these files serves (`python -m glm53.serve DIR`): no tokenizer.json, so the byte tokenizer and GLM-5.3's
chat template, as a preset's."""

import pytest


@pytest.fixture(scope="session")
def serving_model():
    from tests.models import serving_model

    return serving_model()


@pytest.fixture(scope="session")
def serving_dir(serving_model, tmp_path_factory):
    import glm53

    d = tmp_path_factory.mktemp("serving_model")
    glm53.save_pretrained(serving_model, d)
    return str(d)
