"""The public feature front-end: per-sample, deterministic, exact on reference images."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

pytest.importorskip("kymatio")

from clipless.features import FEATURES, Scattering2d, apply_features, build_features


@pytest.fixture(scope="module")
def phi() -> Scattering2d:
    return Scattering2d((1, 16, 16), J=2, L=4, groups=5)


def test_paths_and_shape() -> None:
    # K = 1 + J L + L^2 J (J - 1) / 2 paths per input channel; subsampling by 2^J.
    assert Scattering2d((1, 28, 28)).output_shape == (81, 7, 7)
    assert Scattering2d((3, 32, 32), J=2, L=8, groups=0).output_shape == (243, 8, 8)
    assert Scattering2d((1, 16, 16), J=3, L=4, max_order=1, groups=0).output_shape == (13, 2, 2)
    out = Scattering2d((1, 28, 28))(torch.rand(2, 1, 28, 28))
    assert out.shape == (2, 81, 7, 7)


def test_features_are_per_sample(phi: Scattering2d) -> None:
    """A sample's features never depend on the rest of its batch (the privacy condition)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 1, 16, 16, generator=g)
    batch = phi(x)
    alone = torch.cat([phi(x[i : i + 1]) for i in range(6)])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-6)
    changed = x.clone()
    changed[3] = torch.rand(1, 16, 16, generator=g) * 50.0  # one record replaced by an outlier
    other = phi(changed)
    keep = [0, 1, 2, 4, 5]
    torch.testing.assert_close(other[keep], batch[keep], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(other[3], batch[3])


def test_group_normalisation(phi: Scattering2d) -> None:
    x = torch.rand(4, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    z = phi(x)
    groups = z.reshape(4, phi.groups, -1).double()
    torch.testing.assert_close(
        groups.mean(-1), torch.zeros(4, 5, dtype=torch.float64), atol=1e-5, rtol=0
    )
    var = groups.var(-1, unbiased=False)
    # Reference: the raw coefficients' group variance v becomes v / (v + eps) (torch group_norm).
    raw = Scattering2d((1, 16, 16), J=2, L=4, groups=0)(x).reshape(4, phi.groups, -1).double()
    v = raw.var(-1, unbiased=False)
    torch.testing.assert_close(var, v / (v + 1e-5), rtol=1e-4, atol=1e-6)
    assert float(var[:, 0].min()) > 0.99  # order 0 and the first order-1 paths: large variance
    # ||z||^2 = sum over groups of m var / (var + eps) <= numel: natural_norm bounds every sample.
    assert bool((z.flatten(1).norm(dim=1) <= phi.natural_norm * (1 + 1e-6)).all())  # rounding
    assert phi.natural_norm == pytest.approx(math.sqrt(phi.output_shape[0] * 4 * 4))


def test_constant_image_is_its_own_average() -> None:
    """Order 0 is a low-pass average (filter sum 1); every wavelet has zero mean, so a constant
    image has no order-1 or order-2 energy: exact reference values of the transform."""
    raw = Scattering2d((1, 16, 16), J=2, L=4, groups=0)
    z = raw(torch.full((1, 1, 16, 16), 0.7))
    torch.testing.assert_close(z[0, 0], torch.full((4, 4), 0.7), rtol=1e-4, atol=0)
    assert float(z[0, 1:].abs().max()) < 1e-5


def test_scattering_is_translation_stable() -> None:
    """A one-pixel (circular) shift moves order-0 features by far less than the image moves."""
    raw = Scattering2d((1, 32, 32), J=3, L=4, groups=0)
    x = torch.zeros(1, 1, 32, 32)
    x[0, 0, 10:20, 12:18] = 1.0
    shifted = torch.roll(x, shifts=1, dims=3)
    dz = float((raw(x) - raw(shifted)).norm())
    assert dz < 0.5 * float((x - shifted).norm())


def test_apply_features_matches_direct_call(phi: Scattering2d) -> None:
    x = torch.rand(7, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    y = torch.arange(7)
    out = apply_features(phi, TensorDataset(x, y), batch_size=3)
    torch.testing.assert_close(out.tensors[0], phi(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.tensors[1], y)
    with pytest.raises(ValueError, match="batch_size"):
        apply_features(phi, TensorDataset(x, y), batch_size=0)


def test_build_and_errors() -> None:
    assert FEATURES == ("none", "scatter")
    assert build_features("none", (1, 28, 28)) is None
    assert isinstance(build_features("scatter", (1, 28, 28)), Scattering2d)
    with pytest.raises(ValueError, match="features must be one of"):
        build_features("sift", (1, 28, 28))
    with pytest.raises(ValueError, match="input_shape"):
        Scattering2d((28, 28))
    with pytest.raises(ValueError, match="J must be"):
        Scattering2d((1, 8, 8), J=4)
    with pytest.raises(ValueError, match="groups must be"):
        Scattering2d((1, 28, 28), groups=10)
    with pytest.raises(ValueError, match="max_order"):
        Scattering2d((1, 28, 28), max_order=3)
    with pytest.raises(ValueError, match="expected images"):
        Scattering2d((1, 16, 16), J=2, L=4, groups=5)(torch.zeros(2, 1, 8, 8))


class _Counting(torch.nn.Module):
    """Wraps a front-end and counts its calls (a cache hit makes none)."""

    def __init__(self, inner: Scattering2d) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)

    def extra_repr(self) -> str:
        return self.inner.extra_repr()


def test_cached_features_hit_miss_and_invalidation(tmp_path: Path) -> None:
    from clipless.features import cached_features, feature_cache_key

    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(5, 1, 16, 16, generator=g), torch.arange(5)
    front = _Counting(Scattering2d((1, 16, 16), J=2, L=4, groups=5))
    first, path, found = cached_features(front, TensorDataset(x, y), tmp_path, batch_size=2)
    assert not found and front.calls == 3 and path.is_file() and path.parent == tmp_path
    assert path.stat().st_mode & 0o777 == 0o600  # a copy of training data: owner only
    assert torch.equal(
        first.tensors[0], apply_features(front.inner, TensorDataset(x, y), 2).tensors[0]
    )
    # the same map and data: loaded, not computed, bit for bit the same, labels passed through
    again, path2, found = cached_features(front, TensorDataset(x, y), tmp_path, batch_size=2)
    assert found and path2 == path and front.calls == 3
    assert torch.equal(again.tensors[0], first.tensors[0]) and torch.equal(again.tensors[1], y)
    # any change of the input, the map's configuration, its state or the batching: another key
    key = feature_cache_key(front, x, 2)
    changed = x.clone()
    changed[2, 0, 5, 5] += 1e-6
    assert feature_cache_key(front, changed, 2) != key
    assert feature_cache_key(front, x.double(), 2) != key
    assert feature_cache_key(front, x, 3) != key
    other = _Counting(Scattering2d((1, 16, 16), J=2, L=4, groups=0))
    assert feature_cache_key(other, x, 2) != key
    tampered = _Counting(Scattering2d((1, 16, 16), J=2, L=4, groups=5))
    name = next(iter(tampered.state_dict()))
    tampered.state_dict()[name].mul_(1.5)  # a different filter bank, same configuration
    assert feature_cache_key(tampered, x, 2) != key
    _, path3, found = cached_features(front, TensorDataset(changed, y), tmp_path, batch_size=2)
    assert not found and path3 != path and front.calls == 6


def test_apply_features_names_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        apply_features(torch.nn.Identity(), TensorDataset(torch.zeros(0, 3), torch.zeros(0)))
    with pytest.raises(ValueError, match="batch_size must be an integer"):
        apply_features(torch.nn.Identity(), TensorDataset(torch.zeros(2, 3)), batch_size=1.5)


def test_cache_key_covers_submodules_and_mode() -> None:
    """Containers show nothing in their own ``extra_repr``: the key reads the whole ``repr``."""
    from clipless.features import feature_cache_key

    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    avg = torch.nn.Sequential(torch.nn.AvgPool2d(2))
    key = feature_cache_key(avg, x, 2)
    assert feature_cache_key(torch.nn.Sequential(torch.nn.MaxPool2d(4)), x, 2) != key
    assert feature_cache_key(torch.nn.Sequential(torch.nn.AvgPool2d(2)), x, 2) == key
    assert feature_cache_key(avg.eval(), x, 2) != key


def test_cached_features_recomputes_a_bad_file(tmp_path: Path) -> None:
    from clipless.features import cached_features

    x, y = torch.rand(4, 1, 16, 16, generator=torch.Generator().manual_seed(4)), torch.arange(4)
    front = _Counting(Scattering2d((1, 16, 16), J=2, L=4, groups=5))
    good, path, _ = cached_features(front, TensorDataset(x, y), tmp_path)
    path.write_bytes(b"torn")  # a crash cannot do this (atomic writes), a disk fault can
    with pytest.warns(UserWarning, match="unreadable"):
        out, _, found = cached_features(front, TensorDataset(x, y), tmp_path)
    assert not found and torch.equal(out.tensors[0], good.tensors[0])
    # a readable file whose key is not this one (a collision of the name's prefix, or an edit)
    saved = torch.load(path, weights_only=True)
    torch.save({**saved, "key": "0" * 64}, path)
    with pytest.warns(UserWarning, match="does not hold"):
        out, _, found = cached_features(front, TensorDataset(x, y), tmp_path)
    assert not found and torch.equal(out.tensors[0], good.tensors[0])
    _, _, found = cached_features(front, TensorDataset(x, y), tmp_path)  # rewritten: a hit
    assert found and front.calls == 3
    with pytest.raises(ValueError, match="batch_size"):
        cached_features(front, TensorDataset(x, y), tmp_path, batch_size=0)
    # a cache folder that cannot be written (here a file stands where it should be): a warning,
    # and the features all the same
    blocked = tmp_path / "not-a-folder"
    blocked.write_bytes(b"")
    with pytest.warns(UserWarning, match="could not write the feature cache"):
        out, _, found = cached_features(front, TensorDataset(x, y), blocked / "features")
    assert not found and torch.equal(out.tensors[0], good.tensors[0])


def test_cache_key_covers_the_maps_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited ``forward`` or constant of a clipless map (the same ``repr`` and state) must not
    reuse features computed by the old code (audit note: the key covered neither)."""
    import inspect

    import clipless.features as features_module
    from clipless.features import feature_cache_key

    x = torch.rand(3, 1, 16, 16, generator=torch.Generator().manual_seed(5))
    phi = Scattering2d((1, 16, 16), J=2, L=4, groups=5)
    key = feature_cache_key(phi, x, 2)
    source = Path(inspect.getsourcefile(features_module) or "")
    edited = tmp_path / "features.py"
    edited.write_text(source.read_text().replace("eps", "eps * 2", 1))
    real = inspect.getsourcefile
    monkeypatch.setattr(
        inspect, "getsourcefile", lambda obj: str(edited) if obj is features_module else real(obj)
    )
    assert feature_cache_key(phi, x, 2) != key
    monkeypatch.setattr(inspect, "getsourcefile", real)
    assert feature_cache_key(phi, x, 2) == key
