"""clipless.accounting.guarantee: the frozen privacy claim."""

from __future__ import annotations

import pytest

from clipless.accounting import (
    PrivacyGuarantee,
)


# ------------------------------------------------------------------------------------ guarantee
def test_guarantee_frozen_and_str() -> None:
    g = PrivacyGuarantee(
        epsilon=1.5,
        delta=1e-5,
        accountant="pld",
        neighbouring="add_remove",
        sample_rate=0.01,
        noise_multiplier=1.0,
        steps=1000,
        mechanism="Poisson-subsampled Gaussian",
    )
    with pytest.raises(AttributeError):
        g.epsilon = 0.0  # type: ignore[misc]
    assert "epsilon=1.5" in str(g)
    assert "NOT" not in str(g)
    bad = PrivacyGuarantee(**{**g.to_dict(), "is_dp_guarantee": False})
    assert str(bad).startswith("NOT a DP guarantee")
    with pytest.raises(ValueError, match="delta"):
        PrivacyGuarantee(**{**g.to_dict(), "delta": 2.0})
    with pytest.raises(ValueError, match="accountant"):
        PrivacyGuarantee(**{**g.to_dict(), "accountant": "moments"})
