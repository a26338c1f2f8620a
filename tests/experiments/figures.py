"""What a test can check of a figure an experiment draws: that the PNG decodes to the size its figure was made
at and that each named data series left pixels of its colour (a figure whose data failed to plot is blank
but for its axes and labels, which matplotlib draws in black and grey)."""

from pathlib import Path

import numpy as np
from matplotlib import colors
from matplotlib import image as mpimg


def assert_drawn(path: Path, figsize_in: tuple[float, float], dpi: int, series=("C0",), min_pixels: int = 20) -> None:
    """`path` is a PNG of figsize_in inches at `dpi` in which every colour of `series` (matplotlib colour
    specs, e.g. "C0") covers at least `min_pixels` pixels (within 2% per channel: antialiasing blends edges)."""
    img = mpimg.imread(path)[..., :3]
    want = (round(figsize_in[1] * dpi), round(figsize_in[0] * dpi))
    assert img.shape[:2] == want, f"{path.name}: {img.shape[:2]} pixels, expected {want}"
    for c in series:
        n = int((np.abs(img - np.asarray(colors.to_rgb(c))) < 0.02).all(axis=-1).sum())
        assert n >= min_pixels, f"{path.name}: {n} pixels of {c}, so that series was not drawn"
