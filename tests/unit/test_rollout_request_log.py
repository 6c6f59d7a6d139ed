"""The JSON-lines request log: fixed fields, no text unless asked, disabled without a path."""

import json

from specserve.rollout.request_log import FIELDS, RequestLog


def test_request_log_fields_and_privacy(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    log = RequestLog(path)
    log.write({"id": "a", "status": "ok", "prompt": "secret", "output": "secret2", "junk": 1})
    log.write({"id": "b", "status": "error", "http_status": 400})
    log.close()
    log.write({"id": "c"})  # after close: ignored, no crash
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["a", "b"]
    assert list(lines[0]) == list(FIELDS)
    assert "secret" not in path.read_text() and "junk" not in lines[0]


def test_request_log_with_prompts(tmp_path):
    path = tmp_path / "log.jsonl"
    log = RequestLog(path, log_prompts=True)
    log.write({"id": "a", "prompt": "héllo", "output": "x"})
    log.close()
    rec = json.loads(path.read_text())
    assert rec["prompt"] == "héllo" and rec["output"] == "x"


def test_request_log_disabled():
    log = RequestLog(None)
    assert not log.enabled
    log.write({"id": "a"})
    log.close()
