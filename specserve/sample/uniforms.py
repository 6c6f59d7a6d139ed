"""Counter-based uniforms: u(seed, output position, purpose), the same alone, in any batch, on any device.

What it does: maps (a request's seed, the output position of the token being decided, a purpose) to a
uniform in [0, 1) with no state in between, so that a batched verifier can take every row's uniforms at
once without knowing how many were drawn before, and the per-request reference draws exactly the same
numbers. The batched verifier's inputs are built on the host (`specserve.sample.batch`), which calls
`uniform` per sampled row (~0.4 us each) and sends the values with the rest of the batch; the
reference calls it per draw. The design and why it keeps every seeded guarantee: docs/step-plan.md,
"Random numbers".

The generator is SplitMix64 (Steele, Lea, Flood 2014; the seeding generator of java.util.SplittableRandom
and of xoshiro): a request's stream is SplitMix64 started from mix(seed), read at counter
position * NUM_PURPOSES + purpose + 1. A uniform keeps the top 52 of the 64 bits, so u <= 1 - 2^-52 and
u * total < total for any double total (inverse-CDF sampling never runs past the last token).

What it does not do: sampling itself (`specserve.sample.rejection`, `specserve.sample.verifier`).
"""

from __future__ import annotations

import enum

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
    """The request's stream key: mix(seed) as a signed 64-bit int (`Request.rng_key`). Any Python int is
    a valid seed (taken modulo 2^64)."""
    return _signed(_mix64((seed ^ _SEED_SALT) & _MASK64))


def uniform(key: int, position: int, purpose: int) -> float:
    """One uniform in [0, 1 - 2^-52] for (stream key from `seed_key`, output position >= 0, purpose)."""
    z = (key + (position * NUM_PURPOSES + purpose + 1) * _GAMMA) & _MASK64
    return (_mix64(z) >> (64 - _BITS)) * 2.0**-_BITS
