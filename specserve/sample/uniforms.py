"""Counter-based uniforms: u(seed, output position, purpose), the same alone, in any batch, on any device.

What it does: maps (a request's seed, the output position of the token being decided, a purpose) to a
uniform in [0, 1) with no state in between, so that a batched verifier can draw every row's uniforms at
once without knowing how many were drawn before, and the per-request reference draws exactly the same
numbers. Two implementations of one function: `uniform` (Python ints, the readable reference, used per
request) and `uniforms` (int64 tensor ops, vectorized over rows, any device); a test checks that they
agree bit for bit. The design and why it keeps every seeded guarantee: docs/step-plan.md, "Random numbers".

The generator is SplitMix64 (Steele, Lea, Flood 2014; the seeding generator of java.util.SplittableRandom
and of xoshiro): a request's stream is SplitMix64 started from mix(seed), read at counter
position * NUM_PURPOSES + purpose + 1. A uniform keeps the top 52 of the 64 bits, so u <= 1 - 2^-52 and
u * total < total for any double total (inverse-CDF sampling never runs past the last token).

What it does not do: sampling itself (`specserve.sample.rejection`, `specserve.sample.verifier`).
"""

from __future__ import annotations

import enum

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (odd, 2^64 / golden ratio)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_SEED_SALT = 0x5EC5E7E5A11D5EED  # so that seed 0 does not start the stream at state 0
_BITS = 52
NUM_PURPOSES = 4


class Purpose(enum.IntEnum):
    """What a uniform decides; one stream per purpose, so no number is ever used for two things.

    SAMPLE: draw the target's token at an output position (plain sample, coupled one-hot verification,
        recovered token from the residual, bonus token).
    ACCEPT: the accept test min(1, p/q) of a draft model's sampled draft at an output position.
    DRAFT: a sampling draft model's draw of its draft at an output position.
    """

    SAMPLE = 0
    ACCEPT = 1
    DRAFT = 2


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def seed_key(seed: int) -> int:
    """The request's stream key: mix(seed) as a signed 64-bit int (what `uniforms` takes as `keys`).
    Any Python int is a valid seed (taken modulo 2^64)."""
    return _signed(_mix64((seed ^ _SEED_SALT) & _MASK64))


def uniform(key: int, position: int, purpose: int) -> float:
    """One uniform in [0, 1 - 2^-52] for (stream key from `seed_key`, output position >= 0, purpose)."""
    z = (key + (position * NUM_PURPOSES + purpose + 1) * _GAMMA) & _MASK64
    return (_mix64(z) >> (64 - _BITS)) * 2.0**-_BITS


# The same arithmetic on int64 tensors: multiplication wraps modulo 2^64 (two's complement) and a
# logical right shift is an arithmetic shift with the sign-extended bits masked off.
_GAMMA_S, _M1_S, _M2_S = _signed(_GAMMA), _signed(_M1), _signed(_M2)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniforms(keys: torch.Tensor, positions: torch.Tensor, purposes: torch.Tensor | int) -> torch.Tensor:
    """Vectorized `uniform`.

    Args:
        keys: int64 [N], `seed_key` of each row's request.
        positions: int64 [N], output positions (>= 0).
        purposes: int64 [N] or one int (`Purpose`).

    Returns:
        float64 [N] on the inputs' device, equal bit for bit to `uniform` element by element.
    """
    z = keys + (positions * NUM_PURPOSES + purposes + 1) * _GAMMA_S
    z = (z ^ _shr(z, 30)) * _M1_S
    z = (z ^ _shr(z, 27)) * _M2_S
    z = z ^ _shr(z, 31)
    return _shr(z, 64 - _BITS).to(torch.float64) * 2.0**-_BITS
