"""Privacy accounting: ``dp_accounting`` events, epsilon, noise calibration, the privacy ledger.

This package imports no torch, directly or indirectly (docs/design.md, "Accounting is
framework-free"); a test imports it in a fresh interpreter and checks ``sys.modules``.

The mechanism
-------------
One training step of clipless DP-SGD releases the per-layer noisy sums of the (scaled) per-example
gradients of a Poisson sample of rate ``q`` (every example included independently with
probability ``q``). Layer ``k`` receives Gaussian noise of standard deviation ``sigma_k * G_k``
where ``G_k`` bounds the norm of one example's contribution to that layer. Whitening each layer by
its noise scale shows that the step is *one* Gaussian mechanism with effective noise multiplier
``sigma_eff = (sum_k sigma_k^-2)^(-1/2)`` (docs/design.md, "Noise strategies";
:func:`effective_noise_multiplier`). Such a step is the Poisson-subsampled ("sampled") Gaussian
mechanism of Abadi et al. 2016 (Deep learning with differential privacy) and Mironov, Talwar and
Zhang 2019 (Renyi differential privacy of the sampled Gaussian mechanism), described here as
``PoissonSampledDpEvent(q, GaussianDpEvent(sigma_eff))`` (:func:`gaussian_step_event`) and composed
``T`` times (:func:`dpsgd_event`).

Noise-multiplier convention
---------------------------
``noise_multiplier`` is always ``std / G`` where ``G`` bounds the L2 norm of **one example's
contribution** (the add/remove-one sensitivity of the sum). This is ``dp_accounting``'s convention
for ``GaussianDpEvent`` ("if ||v_i|| <= C, the noise multiplier is s / C"). It does not change with
the neighbouring relation: under replace-one the accountant itself accounts for the difference
``||g - g'|| <= 2 G`` between the replaced example and its replacement (see below). Pass the
multiplier relative to ``G``, never one already halved or doubled for replace-one.

Accountants
-----------
* ``"pld"`` (default): privacy loss distributions, Doroshenko, Ghazi, Kamath, Kumar and
  Manurangsi 2022 (Connect the dots: tighter discrete approximations of privacy loss distributions)
  through ``dp_accounting.pld.PLDAccountant``. The discretisation is *pessimistic by construction*
  (every privacy loss is rounded up, the truncated tail mass is counted as infinite loss), so the
  reported epsilon is an upper bound on the true one, tight to about the discretisation interval.
  Default interval :data:`DEFAULT_PLD_DISCRETIZATION` ``= 1e-4`` (``dp_accounting``'s default):
  measured on 2 CPU cores, ``sigma = 1, q = 0.01, T = 1e3..1e5, delta = 1e-5`` costs 0.5-1.5 s per
  epsilon and overestimates by about ``1e-5`` relative (``1e-3``: 8x faster, ``1e-3`` relative).
* ``"rdp"``: Renyi DP (Mironov 2017; Mironov et al. 2019 for the sampled Gaussian) through
  ``dp_accounting.rdp.RdpAccountant`` with :data:`DEFAULT_RDP_ORDERS`. Cheap, looser than PLD
  (typically 5-15 % larger epsilon).

Neighbouring relations
----------------------
* ``"add_remove"`` (default; docs/design.md "Adjacency and normalisation"): add or remove one
  example.
* ``"replace_one"``: replace one example by another. Both have contribution norm at most ``G``, so
  their difference has norm up to ``2 G`` ("replace-one doubles sensitivities").

  - Without subsampling (``q = 1``) this is exactly the Gaussian mechanism with sensitivity
    ``2 G``: ``epsilon_replace(sigma) == epsilon_add_remove(sigma / 2)``.
  - With Poisson subsampling the PLD accountant uses ``dp_accounting``'s ``REPLACE_ONE`` privacy
    loss distribution: the pair ``P = (1-q) N(0, sigma^2) + q N(-1, sigma^2)`` versus
    ``Q = (1-q) N(0, sigma^2) + q N(+1, sigma^2)`` (units of ``G``): the replaced example and its
    replacement contribute antipodal vectors of norm ``G``, each present with probability ``q``.
    We rely on this pair *dominating* every replace-one pair ``((1-q) N(0) + q N(u),
    (1-q) N(0) + q N(v))`` with ``||u||, ||v|| <= 1`` in every hockey-stick divergence (so the
    composition theorem for dominating pairs, Zhu, Dong and Wang 2022, Theorem 10, applies);
    ``tests/accounting/test_events.py`` checks this domination numerically on a 2-D grid of
    configurations. It sits between the two naive bounds:
    ``epsilon_add_remove(sigma) <= epsilon_replace(sigma) <= epsilon_add_remove(sigma / 2)``
    (tested), with equality on the right at ``q = 1``.
  - The RDP accountant of ``dp_accounting`` 0.6 does not support ``PoissonSampledDpEvent`` under
    ``REPLACE_ONE``, and for a plain ``GaussianDpEvent`` under ``REPLACE_ONE`` it uses sensitivity
    ``C`` instead of ``2 C`` (google/differential-privacy issue #378: epsilon underestimated).
    clipless therefore never hands ``REPLACE_ONE`` to the RDP accountant: for ``q = 1`` it composes
    the exact equivalent ``GaussianDpEvent(sigma / 2)`` under add/remove, and for ``q < 1`` it
    raises ``ValueError`` (use ``accountant="pld"``). (The add/remove pair at sensitivity ``2 G``
    does not dominate the replace-one pair in every divergence, so its RDP is not a proven bound.)

One-shot releases
-----------------
A statistic of the whole dataset released once with Gaussian noise (``q = 1``; e.g. the private
mean of the unit-normalised inputs that centres the features,
:func:`clipless.features.release_mean`) is ``GaussianDpEvent(sigma)`` in the same convention.
It is composed with the steps by the accountant (``releases=`` of :func:`epsilon` and
:func:`calibrate_noise`; :meth:`PrivacyLedger.record_release`), so the steps are calibrated for
what the release leaves of the budget, without splitting epsilon by basic composition.

Degenerate noise
----------------
``noise_multiplier = 0`` is accepted and means *no privacy* (``dp_accounting``'s
``NonPrivateDpEvent``: epsilon is ``inf`` and delta is 1). ``noise_multiplier = inf`` means an
infinitely noisy step that releases nothing (``NoOpDpEvent``; a layer with ``G_k = 0``).
Negative or NaN multipliers are rejected.

Layout
------
:mod:`~clipless.accounting.events` (events, effective multiplier, replace-one translation for RDP),
:mod:`~clipless.accounting.accountant` (:class:`Accountant`, :func:`epsilon`),
:mod:`~clipless.accounting.calibration` (:func:`calibrate_noise`),
:mod:`~clipless.accounting.guarantee` (:class:`PrivacyGuarantee`),
:mod:`~clipless.accounting.ledger` (:class:`LedgerEntry`, :class:`LedgerRelease`,
:class:`PrivacyLedger`) and
``_checks`` (argument validation, accepted settings); every public name is re-exported here.
"""

from __future__ import annotations

from clipless.accounting._checks import (
    ACCOUNTANTS,
    DEFAULT_PLD_DISCRETIZATION,
    DEFAULT_RDP_ORDERS,
    NEIGHBOURING_RELATIONS,
    AccountantKind,
    Neighbouring,
)
from clipless.accounting.accountant import Accountant, epsilon, event_epsilon
from clipless.accounting.calibration import (
    PLD_MAX_EPSILON,
    ReleasesExceedTargetError,
    calibrate_noise,
)
from clipless.accounting.events import (
    dpsgd_event,
    effective_noise_multiplier,
    event_from_dict,
    event_to_dict,
    gaussian_step_event,
    repeated,
)
from clipless.accounting.guarantee import PrivacyGuarantee
from clipless.accounting.ledger import (
    LEDGER_EVENT_VERSION,
    LEDGER_FORMAT,
    LEDGER_VERSION,
    LedgerEntry,
    LedgerRelease,
    PrivacyLedger,
)

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_PLD_DISCRETIZATION",
    "DEFAULT_RDP_ORDERS",
    "LEDGER_EVENT_VERSION",
    "LEDGER_FORMAT",
    "LEDGER_VERSION",
    "NEIGHBOURING_RELATIONS",
    "PLD_MAX_EPSILON",
    "Accountant",
    "AccountantKind",
    "LedgerEntry",
    "LedgerRelease",
    "Neighbouring",
    "PrivacyGuarantee",
    "PrivacyLedger",
    "ReleasesExceedTargetError",
    "calibrate_noise",
    "dpsgd_event",
    "effective_noise_multiplier",
    "epsilon",
    "event_epsilon",
    "event_from_dict",
    "event_to_dict",
    "gaussian_step_event",
    "repeated",
]
