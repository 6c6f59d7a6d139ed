"""Property-based fuzzing of the HTTP API (hypothesis, bounded for CI): every catalogued bad request is a
4xx naming its `param`, and any generated body is answered with a 4xx or a valid 2xx; never a 5xx, never a
200 with an error inside, never internal text. The recorded run with more examples over a real model is
benchmarks/server_reliability.py (docs/benchmarks/server_reliability_smollm2-135m-instruct.json)."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.rollout.profiles import profile_set_from_dict
from specserve.server import fuzz
from specserve.server.api import ServerSettings, create_app
from specserve.server.launcher import ServerThread
from tests.helpers.fake_engine import fake_client

TOKEN = "t"
CATALOGUE = fuzz.catalogue()


@pytest.fixture(scope="module")
def server():
    profiles = profile_set_from_dict({"profiles": {"baseline": None, "ngram": {"method": "ngram"}}})
    app = create_app(fake_client(max_model_len=256), profiles,
                     ServerSettings(admin_token=TOKEN, tool_call_parser="hermes", max_body_bytes=256 * 1024))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.base_url, timeout=30,
                                                headers={"authorization": f"Bearer {TOKEN}"}) as c:
        srv.client = c
        yield srv


def _send(srv, method, path, body):
    r = srv.client.request(method, path, content=body, headers={"content-type": "application/json"})
    return r.status_code, r.text


def test_catalogue_is_large_and_named():
    assert len(CATALOGUE) >= 400 and len({b.kind for b in CATALOGUE}) >= 150


@pytest.mark.parametrize("bad", CATALOGUE, ids=[b.kind for b in CATALOGUE])
def test_every_catalogued_bad_request_is_refused(server, bad):
    status, text = _send(server, bad.method, bad.path, bad.body)
    assert fuzz.check_answer(bad, status, text) is None, (status, text)


_json = st.recursive(st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_FIELDS = st.sampled_from(fuzz._FIELDS + ["messages", "prompt", "tools", "tool_choice"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(chat=st.booleans(), fields=st.dictionaries(_FIELDS, _json, min_size=1, max_size=3))
def test_any_body_is_4xx_or_a_valid_2xx(server, chat, fields):
    body = dict(fuzz.BASE_CHAT if chat else fuzz.BASE_COMPLETIONS)
    body.update(fields)
    body["max_tokens"] = body["max_tokens"] if "max_tokens" in fields else 3
    status, text = _send(server, "POST", fuzz.CHAT if chat else fuzz.COMPLETIONS, json.dumps(body).encode())
    assert fuzz.check_answer(None, status, text, stream=body.get("stream") is True) is None, (status, text, body)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(CATALOGUE), st.randoms(use_true_random=False))
def test_a_fault_is_found_whatever_else_the_body_holds(server, bad, rng):
    for v in fuzz.variants(bad, rng):
        status, text = _send(server, v.method, v.path, v.body)
        assert fuzz.check_answer(v, status, text) is None, (v.kind, status, text)
