"""Fixtures the peer-tier test files share."""

import pytest

from kvcache.tiers.p2p import PeerTier


@pytest.fixture
def tiers(request):
    """tiers(**opts) -> a PeerTier on 127.0.0.1 (a free port) with the calling module's fingerprint `FP`;
    every tier made is shut down after the test."""
    made = []

    def make(**opts):
        made.append(PeerTier(fingerprint=request.module.FP, host="127.0.0.1", port=0, **opts))
        return made[-1]

    yield make
    for t in made:
        t.shutdown(wait=False)
