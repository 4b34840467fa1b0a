"""The protocol, servers and neighbouring checks shared by the federated releases (private).

:func:`~clipless.federated.federated_ecdf`, :func:`~clipless.federated.federated_roc` and
:func:`~clipless.federated.session.make_session` accept the same combinations, so they refuse
the others with the same sentences, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

FSS_ADD_REMOVE = (
    "protocol='fss' needs neighbouring='replace_one': every owner sends one key per value, so "
    "each server learns every owner's number of values and the total n, which add/remove "
    "neighbours differ in (replace-one neighbours do not); use protocol='shares'"
)


def _alternatives(options: Sequence[str]) -> str:
    quoted = [repr(o) for o in options]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def check_protocol(
    protocol: str,
    servers: int,
    neighbouring: str,
    protocols: Sequence[str] = ("local", "shares", "fss"),
) -> None:
    """Refuse a protocol outside ``protocols``, an unknown neighbouring, and the two
    combinations FSS does not support (other than 2 servers; add/remove neighbours)."""
    if protocol not in protocols:
        raise ValueError(f"protocol must be {_alternatives(protocols)}, got {protocol!r}")
    if neighbouring not in ("replace_one", "add_remove"):
        raise ValueError(
            f"neighbouring must be 'replace_one' or 'add_remove', got {neighbouring!r}"
        )
    if protocol == "fss" and servers != 2:
        raise ValueError(
            f"protocol='fss' uses exactly 2 servers (a two-party DCF), got servers={servers}"
        )
    if protocol == "fss" and neighbouring == "add_remove":
        raise ValueError(FSS_ADD_REMOVE)
