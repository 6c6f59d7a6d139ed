"""`specserve serve` argument handling (no model is loaded: every case fails before that)."""

import json

import pytest

from specserve.cli import build_parser, main
from specserve.config import ConfigError
from specserve.server.launcher import profile_set_from_args


def test_serve_arguments_parse():
    a = build_parser().parse_args(["serve", "--model", "m", "--allow-profile-override", "--admin-token", "t",
                                   "--request-log", "r.jsonl", "--log-prompts", "--max-queue", "3", "--port", "9"])
    assert (a.model, a.allow_profile_override, a.admin_token, a.request_log, a.log_prompts, a.max_queue, a.port) == (
        "m", True, "t", "r.jsonl", True, 3, 9)
    assert a.host == "127.0.0.1" and a.speculative_config is None and a.profiles is None


def test_profile_set_from_args(tmp_path):
    assert list(profile_set_from_args(None, None).profiles) == ["baseline"]
    ps = profile_set_from_args(None, '{"method": "ngram", "num_speculative_tokens": 3}')
    assert ps.weights == {"baseline": 0.0, "default": 1.0} and ps.profiles["default"].num_speculative_tokens == 3
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"profiles": {"n": {"method": "ngram"}}, "weights": {"n": 1}}))
    assert list(profile_set_from_args(str(f), None).profiles) == ["baseline", "n"]
    with pytest.raises(ConfigError):
        profile_set_from_args(str(f), '{"method": "ngram"}')


@pytest.mark.parametrize("extra", [["--speculative-config", "{bad"], ["--speculative-config", '{"method": "eagle"}'],
                                   ["--profiles", "/nonexistent/p.json"]])
def test_serve_config_errors_exit_2(extra, capsys):
    assert main(["serve", "--model", "whatever"] + extra) == 2
    assert capsys.readouterr().err.startswith("specserve: error:")


def test_step_cost_command(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`specserve step-cost` measures once, caches, prints the table and the JSON last line."""
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    argv = ["step-cost", "--model", str(tiny_model_dir), "--max-num-seqs", "2", "--max-model-len", "128",
            "--max-num-batched-tokens", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    table = json.loads(out[-1])
    assert table["schema"] == "specserve.step_cost/2" and table["tokens"] == list(range(1, 17))
    assert table["batch_ms"] == []  # the uniform-batch grid is measured on CUDA only
    assert "new tokens" in "\n".join(out) and len(list((tmp_path / "step_cost").glob("*.json"))) == 1
    assert main(argv) == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ms"] == table["token_ms"]
    assert main(argv + ["--refresh"]) == 0
