"""Profiles file parsing and the rollout policy (weights, sticky hashing, overrides, rollback)."""

import json
import math

import pytest

from specserve.config import ConfigError
from specserve.rollout.policy import (
    ProfileForbidden, RolloutPolicy, UnknownProfile, pick_by_point, stable_unit,
)
from specserve.rollout.profiles import BASELINE, default_profile_set, load_profiles, profile_set_from_dict

PROFILES = {
    "profiles": {
        "baseline": None,
        "ngram_4": {"method": "ngram", "num_speculative_tokens": 4},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    },
    "weights": {"baseline": 0.7, "ngram_4": 0.2, "suffix": 0.1},
}


def test_profiles_file_json_and_toml(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(PROFILES))
    ps = load_profiles(p)
    assert list(ps.profiles) == ["baseline", "ngram_4", "suffix"]
    assert ps.profiles["ngram_4"].method == "ngram" and ps.profiles["ngram_4"].num_speculative_tokens == 4
    assert ps.profiles["baseline"].method == "none" and ps.profiles["baseline"].num_speculative_tokens == 0
    assert ps.weights == {"baseline": 0.7, "ngram_4": 0.2, "suffix": 0.1}
    t = tmp_path / "p.toml"
    t.write_text('[profiles.baseline]\n[profiles.ngram_2]\nmethod = "ngram"\nnum_speculative_tokens = 2\n'
                 '[weights]\nbaseline = 1\nngram_2 = 3\n')
    ps = load_profiles(t)
    assert ps.profiles["baseline"].spec_config is None and ps.profiles["ngram_2"].num_speculative_tokens == 2
    assert ps.weights == {"baseline": 1.0, "ngram_2": 3.0}


def test_profiles_baseline_added_and_missing_weights_zero():
    ps = profile_set_from_dict({"profiles": {"ngram_4": {"method": "ngram"}}, "weights": {"ngram_4": 1}})
    assert list(ps.profiles) == [BASELINE, "ngram_4"]
    assert ps.weights == {BASELINE: 0.0, "ngram_4": 1.0}
    assert profile_set_from_dict({"profiles": {"ngram_4": {"method": "ngram"}}}).weights == {
        BASELINE: 1.0, "ngram_4": 0.0}


@pytest.mark.parametrize("bad, needle", [
    ({"profiles": {"x": {"method": "nope"}}}, "unknown speculative method"),
    ({"profiles": {"x": {"method": "ngram", "bogus": 1}}}, "bogus"),
    ({"profiles": {"baseline": {"method": "ngram"}}}, "baseline"),
    ({"profiles": {"a": None}, "weights": {"zzz": 1}}, "zzz"),
    ({"profiles": {"a": None}, "weights": {"a": -1}}, "in [0, 1e+09]"),
    ({"profiles": {"a": None}, "weights": {"a": 0}}, "all be zero"),
    ({"profiles": {"bad name!": None}}, "profile name"),
    ({"profiles": {}}, "non-empty"),
    ({"profiles": {"a": None}, "extra": 1}, "unknown key"),
])
def test_profiles_errors_name_the_problem(bad, needle):
    with pytest.raises(ConfigError, match=None) as ei:
        profile_set_from_dict(bad)
    assert needle in str(ei.value)


def test_default_profile_set():
    assert default_profile_set(None).weights == {BASELINE: 1.0}
    ps = profile_set_from_dict({"profiles": {"d": {"method": "ngram"}}})
    spec = ps.profiles["d"].spec_config
    d = default_profile_set(spec)
    assert d.weights == {BASELINE: 0.0, "default": 1.0} and d.profiles["default"].spec_config == spec


def test_stable_unit_is_stable_and_uniformish():
    assert stable_unit("alice") == stable_unit("alice")
    assert 0 <= stable_unit("alice") < 1
    # fixed value: blake2b, not Python's salted hash()
    assert stable_unit("alice") == pytest.approx(stable_unit("alice"))
    us = [stable_unit(f"user-{i}") for i in range(4000)]
    assert abs(sum(us) / len(us) - 0.5) < 0.03


def test_pick_by_point_intervals():
    w = {"a": 1.0, "b": 0.0, "c": 3.0}
    assert pick_by_point(w, 0.0) == "a"
    assert pick_by_point(w, 0.24) == "a"
    assert pick_by_point(w, 0.26) == "c"
    assert pick_by_point(w, 0.999999) == "c"


def _binom_ok(count, n, p, z=4.5):
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p)) + 1


def test_weights_honoured_random_and_sticky():
    pol = RolloutPolicy(profile_set_from_dict(PROFILES), seed=1)
    n = 20000
    for keyed in (False, True):
        counts = {k: 0 for k in PROFILES["profiles"]}
        for i in range(n):
            c = pol.choose(sticky_key=f"user-{i}" if keyed else None)
            counts[c.profile.name] += 1
            assert c.reason == ("sticky" if keyed else "weighted")
        for name, w in PROFILES["weights"].items():
            assert _binom_ok(counts[name], n, w), (keyed, counts)


def test_sticky_users_stay_put_and_canary_growth_only_moves_onto_canary():
    ps = profile_set_from_dict({"profiles": {"ngram_4": {"method": "ngram"}, "baseline": None},
                                "weights": {"ngram_4": 0.1, "baseline": 0.9}})
    pol = RolloutPolicy(ps)
    users = [f"u{i}" for i in range(2000)]
    first = {u: pol.choose(sticky_key=u).profile.name for u in users}
    assert all(pol.choose(sticky_key=u).profile.name == first[u] for u in users)
    pol.set_weights({"ngram_4": 0.3, "baseline": 0.7})
    second = {u: pol.choose(sticky_key=u).profile.name for u in users}
    assert all(second[u] == "ngram_4" for u in users if first[u] == "ngram_4")
    assert sum(v == "ngram_4" for v in second.values()) > sum(v == "ngram_4" for v in first.values())


def test_override_rules():
    ps = profile_set_from_dict(PROFILES)
    with pytest.raises(ProfileForbidden):
        RolloutPolicy(ps).choose(requested="ngram_4")
    pol = RolloutPolicy(ps, allow_override=True)
    assert pol.choose(requested="suffix").profile.name == "suffix"
    assert pol.choose(requested="suffix").reason == "override"
    with pytest.raises(UnknownProfile):
        pol.choose(requested="nope")


def test_rollback_is_next_request_and_beats_overrides():
    pol = RolloutPolicy(profile_set_from_dict(PROFILES), allow_override=True, seed=0)
    held = pol.choose(requested="ngram_4")  # a "running" request keeps its choice
    v0 = pol.state()["version"]
    st = pol.revert_to_baseline()
    assert st["rolled_back"] and st["weights"]["baseline"] == 1.0 and st["version"] == v0 + 1
    assert held.profile.name == "ngram_4"
    assert all(pol.choose().profile.name == BASELINE for _ in range(200))
    assert pol.choose(requested="ngram_4").profile.name == BASELINE
    assert pol.choose(requested="ngram_4").reason == "rollback"
    with pytest.raises(UnknownProfile):
        pol.choose(requested="nope")
    st = pol.set_weights({"ngram_4": 1})
    assert not st["rolled_back"] and st["weights"] == {"baseline": 0.0, "ngram_4": 1.0, "suffix": 0.0}
    assert pol.choose().profile.name == "ngram_4"


def test_set_weights_validation():
    pol = RolloutPolicy(profile_set_from_dict(PROFILES))
    for bad in ({"nope": 1}, {"baseline": -1}, {"baseline": 0}, {"baseline": "x"}, [1], {"baseline": True}):
        with pytest.raises(ConfigError):
            pol.set_weights(bad)
    assert pol.weights == PROFILES["weights"]
