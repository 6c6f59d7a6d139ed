"""`specserve sweep` end to end on a tiny random-weight model (fp32, CPU): against one running server
(profiles added through the admin API, adaptive included) and against external servers started from a
command template; the files, the table, the recommendation and the last JSON line."""
from __future__ import annotations

import json
import sys

import pytest

from specserve.cli import main
from tests.helpers.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sweep") / "tiny", arch="qwen2", max_position_embeddings=4096)


def test_sweep_one_server_with_admin_api(tiny, tmp_path, capsys):
    from specserve.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.rollout.profiles import default_profile_set
    from specserve.server.api import ServerSettings, create_app
    from specserve.server.async_engine import AsyncEngine
    from specserve.server.launcher import ServerThread

    engine = LLMEngine(EngineConfig(model=str(tiny), dtype="float32", device="cpu", max_num_seqs=4))
    app = create_app(AsyncEngine(engine), default_profile_set(None),
                     ServerSettings(admin_token="t", allow_profile_override=True))
    with ServerThread(app) as srv:
        argv = ["sweep", "--base-url", srv.base_url + "/v1", "--admin-token", "t", "--methods", "ngram,suffix",
                "--k", "2,4", "--concurrency", "1,2", "--segments", "code,chat", "--num-prompts", "2",
                "--max-tokens", "8", "--repeats", "2", "--no-progress", "--output-dir", str(tmp_path)]
        assert main(argv) == 0  # the default: no pruning
        out = capsys.readouterr().out
        # a second sweep on the same server adds its own profiles (no clash with the first one's); it prunes
        # after the first repeat with a margin so wide that only the best and the baseline survive
        # (and runs each profile's requests back to back: --no-interleave)
        assert main(argv[:-1] + [str(tmp_path / "again"), "--prune-margin", "0.001", "--no-interleave"]) == 0
        capsys.readouterr()
        import httpx

        profiles = httpx.get(srv.base_url + "/admin/profiles", headers={"authorization": "Bearer t"}).json()["profiles"]
        prom = httpx.get(srv.base_url + "/metrics").text
    # the adaptive schedule's state is in /metrics: the measured step cost, k chosen per profile, estimates
    assert 'specserve:step_cost_forward_seconds{model="tiny",num_tokens="1",role="target"}' in prom
    assert 'specserve:step_cost_draft_overhead_seconds{model="tiny",role="target"}' in prom
    adaptive_name = next(n for n in profiles if n.endswith(".ngram_adaptive"))
    assert f'specserve:spec_decode_adaptive_steps_total{{k="0",profile="{adaptive_name}"}}' in prom
    assert f'specserve:spec_decode_acceptance_estimate{{position="1",profile="{adaptive_name}"}}' in prom
    summary = json.loads(out.strip().splitlines()[-1])
    recs = summary["recommendations"]
    assert {(r["segment"], r["concurrency"]) for r in recs} == {("code", 1), ("code", 2), ("chat", 1), ("chat", 2)}
    names = {"baseline", "ngram_k2", "ngram_k4", "ngram_adaptive", "suffix_k2", "suffix_k4", "suffix_adaptive"}
    assert all(r["profile"] in names and r["spread"][0] <= r["speedup"] <= r["spread"][1] for r in recs)
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert len(result["runs"]) == 2 * 2 * 2 * len(names) and result["errors"] == 0
    assert result["config"]["prune_margin"] == 0 and not result["pruned"] and result["config"]["interleave"]
    assert {r["profile"] for r in result["rows"]} == names
    # every profile ran in every (repeat, segment, concurrency), in a rotated order
    orders = [tuple(r["profile"] for r in result["runs"][i:i + len(names)]) for i in range(0, len(result["runs"]), len(names))]
    assert len(set(orders)) > 1 and all(set(o) == names for o in orders)
    rp = json.loads((tmp_path / "recommended_profiles.json").read_text())
    assert rp["weights"] == {"baseline": 1.0} and "baseline" in rp["profiles"]
    assert set(rp["profiles"]) == {"baseline"} | {r["profile"] for r in recs}
    assert "recommended for code at c=1" in (tmp_path / "table.txt").read_text()
    html = (tmp_path / "report.html").read_text()
    assert html.count("plotly.js") >= 1 and "Pareto" in html and "acceptance by draft position" in html
    # the profiles were added at run time with weight 0, suffix ones each with their own proposer
    added = [n for n in profiles if n.startswith("sweep")]
    assert len(added) == 2 * (len(names) - 1)
    caps = {profiles[n]["config"].get("suffix_decoding_max_cached_requests") for n in added if "suffix" in n}
    assert len(caps) == 6
    # the pruned re-run: the second repeat of each (segment, concurrency) ran only the profiles not pruned,
    # the pruned rows are marked, and no recommendation names one
    again = json.loads((tmp_path / "again" / "sweep.json").read_text())
    assert again["config"]["prune_margin"] == 0.001 and again["pruned"] and not again["config"]["interleave"]
    cut = {(p["segment"], p["concurrency"], p["profile"]) for p in again["pruned"]}
    second = {(r["segment"], r["concurrency"], r["profile"]) for r in again["runs"] if r["repeat"] == 1}
    assert not cut & second and len(second) + len(cut) == 2 * 2 * len(names)
    assert {(r["segment"], r["concurrency"], r["profile"]) for r in again["rows"] if r["pruned"]} == cut
    assert all((r["segment"], r["concurrency"], r["profile"]) not in cut for r in again["recommendations"])
    assert not any(p["profile"] == "baseline" for p in again["pruned"])


def test_sweep_external_servers_from_a_template(tiny, tmp_path, capsys):
    cmd = (f"{sys.executable} -m specserve.cli serve --model {tiny} --port {{port}} --dtype float32 --device cpu "
           "--max-num-seqs 2 --log-level warning {speculative_config_arg}")
    assert main(["sweep", "--server-cmd", cmd, "--methods", "ngram", "--k", "3", "--no-adaptive", "--concurrency", "1",
                 "--segments", "code", "--num-prompts", "2", "--max-tokens", "6", "--repeats", "1", "--no-progress",
                 "--no-html", "--server-timeout", "300", "--output-dir", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["profile"] in ("baseline", "ngram_k3") for r in summary["recommendations"]] == [True]
    assert (tmp_path / "server-ngram_k3.log").exists() and not (tmp_path / "report.html").exists()
    result = json.loads((tmp_path / "sweep.json").read_text())
    spec = [r for r in result["runs"] if r["profile"] == "ngram_k3"]
    assert spec and spec[0]["metrics"].get("num_drafts") is not None  # the server's default profile speculated


def test_sweep_usage_errors(capsys):
    assert main(["sweep", "--methods", "ngram"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert main(["sweep", "--base-url", "http://127.0.0.1:9/v1", "--methods", "eagle"]) == 2
    assert "not supported" in capsys.readouterr().err
    assert main(["sweep", "--base-url", "http://127.0.0.1:9/v1", "--segments", "nope"]) == 2
    assert "unknown dataset" in capsys.readouterr().err
    assert main(["sweep", "--base-url", "http://127.0.0.1:9/v1", "--k", "0"]) == 2
    assert main(["sweep", "--server-cmd", "true", "--prune-margin", "0.2"]) == 2
    assert "--prune-margin works with --base-url only" in capsys.readouterr().err
    assert main(["sweep", "--base-url", "http://127.0.0.1:9/v1", "--prune-margin", "1.5"]) == 2
    assert "--prune-margin must be in [0, 1)" in capsys.readouterr().err
    for bad in ("-0.5", "2", "nan"):
        assert main(["sweep", "--base-url", "http://127.0.0.1:9/v1", "--min-noise", bad]) == 2
        assert "--min-noise must be in [0, 1)" in capsys.readouterr().err
    assert main(["sweep", "--base-url", "http://127.0.0.1:9/v1", "--admin-token", "x"]) == 2
    assert "cannot reach" in capsys.readouterr().err
