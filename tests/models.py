"""The test models' configurations, shared by the fixtures of tests/conftest.py and the engine and server
processes the tests start (which must build the same weights)."""

import glm53


def two_layers(preset: str):
    """`preset` cut to 2 layers: a full then a shared indexer layer, dense then MoE (its MTP layer kept):
    every code path of its layers (IndexShare included) at a quarter of the 8-layer presets' depth."""
    return glm53.get_preset(preset).replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                            mlp_layer_types=("dense", "sparse"))


def four_layers(preset: str):
    """`preset` cut to 4 layers: full, full, shared, shared indexers (IndexShare groups of 1 and 3 layers:
    groups of unequal length), dense then MoE (its MTP layer kept), at half the 8-layer presets' depth."""
    return glm53.get_preset(preset).replace(num_hidden_layers=4, indexer_types=("full", "full", "shared", "shared"),
                                            mlp_layer_types=("dense", "sparse", "sparse", "sparse"))


def small_model(seed: int = 0):
    """tests/conftest.py's `small_model` (seed 0): the tiny preset's 2-layer cut with random weights large
    enough that logits are far from uniform."""
    return glm53.init(two_layers("tiny"), seed=seed, std=0.1)


def serving_model():
    """The weights the servers of tests/glm53 serve (saved as a checkpoint, `save_pretrained`): the tiny
    preset's 2-layer cut at glm53.init's default scale, seed 0 (sampled tokens vary with the seed)."""
    return glm53.init(two_layers("tiny"), seed=0)
