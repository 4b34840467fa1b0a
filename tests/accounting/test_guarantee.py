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


def test_numpy_numbers_are_stored_as_python_numbers() -> None:
    """Audit finding: a NumPy delta was kept as np.float32 and to_dict() was not JSON."""
    import json

    import numpy as np

    g = PrivacyGuarantee(
        epsilon=np.float64(1.5),
        delta=np.float32(1e-5),
        accountant="pld",
        neighbouring="add_remove",
        sample_rate=np.float32(0.25),
        noise_multiplier=np.float64(1.1),
        steps=np.int64(3),
        mechanism="m",
    )
    assert {type(v) for v in (g.epsilon, g.delta, g.sample_rate, g.noise_multiplier)} == {float}
    assert type(g.steps) is int
    assert json.loads(json.dumps(g.to_dict()))["steps"] == 3
