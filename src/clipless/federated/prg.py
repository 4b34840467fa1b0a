"""AES-128 pseudorandom generators and functions (``cryptography``'s OpenSSL AES, AES-NI).

* :func:`prg_words` -- AES-128 in counter mode as a PRG: a 16-byte seed expands to any number
  of uniform 64-bit words. Owners send such seeds instead of ``m - 1`` of their ``m`` additive
  shares (a seed is 16 bytes, a share ``8 d`` bytes).
* :func:`prf_words` / :func:`aes_ecb` -- AES-128 as a PRF on 128-bit inputs (a block cipher is a
  pseudorandom permutation, hence a PRF up to the birthday bound ``q^2 / 2^129``), evaluated for
  many inputs in one batched ECB call over a numpy buffer.
* :class:`AesCtrRandom` -- a :class:`random.Random` whose bits come from AES-128-CTR under a
  key, so that :mod:`clipless.stats.noise`'s exact samplers can be driven by a PRF-derived key
  (the tree-node noise of :mod:`clipless.federated.noise`).
* :func:`random_seed` -- 16 fresh bytes from the operating system (:func:`secrets.token_bytes`).

Security: AES-128-CTR under a uniformly random key is a PRG (its keystream is computationally
indistinguishable from uniform as long as AES is a PRP; Bellare, Desai, Jokipii, Rogaway 1997).
The counter starts at the 16-byte nonce (default zero); a key must never be reused with the
same nonce for two different purposes, which the callers ensure by deriving keys per purpose.
"""

from __future__ import annotations

import random
import secrets
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from numpy.typing import NDArray

__all__ = ["AesCtrRandom", "aes_ecb", "prf_words", "prg_bytes", "prg_words", "random_seed"]

SEED_BYTES = 16


def _check_key(key: bytes, name: str = "seed") -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"{name} must be bytes, got {type(key).__name__}")
    if len(key) != SEED_BYTES:
        raise ValueError(f"{name} must be {SEED_BYTES} bytes (an AES-128 key), got {len(key)}")
    return bytes(key)


def random_seed() -> bytes:
    """16 uniformly random bytes from the operating system's CSPRNG."""
    return secrets.token_bytes(SEED_BYTES)


def prg_bytes(seed: bytes, nbytes: int, nonce: int = 0) -> bytes:
    """``nbytes`` bytes of the AES-128-CTR keystream of ``seed`` starting at counter ``nonce``."""
    key = _check_key(seed)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    enc = Cipher(algorithms.AES(key), modes.CTR(int(nonce).to_bytes(16, "big"))).encryptor()
    return enc.update(bytes(nbytes))


def prg_words(seed: bytes, n: int, nonce: int = 0) -> NDArray[np.uint64]:
    """``n`` pseudorandom uniform words of ``Z_2^64`` (little-endian) from AES-128-CTR(seed).

    Args:
        seed: a 16-byte key.
        n: how many words, ``>= 0``.
        nonce: the counter block the keystream starts at.
    """
    return np.frombuffer(prg_bytes(seed, 8 * n, nonce), dtype="<u8").astype(np.uint64)


def aes_ecb(key: bytes, blocks: NDArray[np.uint8]) -> NDArray[np.uint8]:
    """AES-128-ECB of every 16-byte row of ``blocks`` (shape ``(k, 16)``), one batched call."""
    k = _check_key(key, "key")
    arr = np.ascontiguousarray(blocks, dtype=np.uint8)
    if arr.ndim != 2 or arr.shape[1] != 16:
        raise ValueError(f"blocks must have shape (k, 16), got {arr.shape}")
    enc = Cipher(algorithms.AES(k), modes.ECB()).encryptor()
    out = enc.update(arr.tobytes()) + enc.finalize()
    return np.frombuffer(out, dtype=np.uint8).reshape(arr.shape).copy()


def prf_words(key: bytes, inputs: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """``F_key(x)``: the first 64 bits of ``AES_key(x)`` for each row ``x`` of ``inputs``.

    ``inputs`` has shape ``(k, 2)`` (two 64-bit words = one 128-bit block) or ``(k,)`` (high
    word zero). Used for node-indexed noise shares: share of node ``x`` = ``F_seed(x)``.

    Args:
        key: a 16-byte key.
        inputs: the blocks, shape ``(k, 2)`` or ``(k,)``.

    Raises:
        ValueError: ``inputs`` of another shape, or a key that is not 16 bytes.
    """
    arr = np.asarray(inputs, dtype=np.uint64)
    if arr.ndim == 1:
        arr = np.stack([arr, np.zeros_like(arr)], axis=1)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"inputs must have shape (k,) or (k, 2), got {arr.shape}")
    blocks = np.ascontiguousarray(arr.astype("<u8")).view(np.uint8).reshape(-1, 16)
    out = aes_ecb(key, blocks)
    return out.view("<u8")[:, 0].astype(np.uint64)


class AesCtrRandom(random.Random):
    """A :class:`random.Random` reading its bits from the AES-128-CTR keystream of ``key``.

    Deterministic given ``key`` (and ``nonce``), computationally indistinguishable from true
    randomness when ``key`` is uniform and secret. ``getrandbits(k)`` consumes ``ceil(k / 8)``
    bytes (little-endian, excess high bits dropped); ``randrange`` and ``randbytes`` are built on
    it, so :mod:`clipless.stats.noise`'s exact samplers run unchanged on top of it.

    Args:
        key: a 16-byte key (uniform and secret for the indistinguishability).
        nonce: the counter block the keystream starts at.
    """

    _BUFFER = 4096

    def __init__(self, key: bytes, nonce: int = 0) -> None:
        self._key = _check_key(key, "key")
        self._enc = Cipher(
            algorithms.AES(self._key), modes.CTR(int(nonce).to_bytes(16, "big"))
        ).encryptor()
        self._buf = b""
        self._pos = 0
        super().__init__(0)

    def seed(self, a: Any = None, version: int = 2) -> None:
        # random.Random.__init__ calls seed(); the state is the AES key, nothing to do here
        return None

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            rest = self._buf[self._pos :]
            need = max(self._BUFFER, n - len(rest))
            self._buf = rest + self._enc.update(bytes(need))
            self._pos = 0
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def getrandbits(self, k: int) -> int:
        if k < 0:
            raise ValueError("number of bits must be non-negative")
        if k == 0:
            return 0
        nbytes = (k + 7) // 8
        return int.from_bytes(self._take(nbytes), "little") >> (8 * nbytes - k)

    def randbytes(self, n: int) -> bytes:
        return self._take(int(n))

    def random(self) -> float:
        return (self.getrandbits(53)) * (2.0**-53)

    def getstate(self) -> Any:
        raise NotImplementedError("AesCtrRandom has no restorable state; re-create it from the key")

    def setstate(self, state: Any) -> None:
        raise NotImplementedError("AesCtrRandom has no restorable state; re-create it from the key")
