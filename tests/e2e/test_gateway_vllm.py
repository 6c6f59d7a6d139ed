"""Opt-in (`-m vllm`): a real vLLM fleet behind the gateway. Starts a vLLM baseline server and a vLLM
ngram server (CPU build, fp32, one core each), runs a small staged rollout through the gateway (gates
from what the gateway measures; acceptance read from vLLM's /metrics; the shadow check replays greedy
requests), then `specserve bench` through the gateway on both profiles.

Skipped unless SPECSERVE_VLLM_PYTHON names a python that has vLLM (e.g. /work/vllm-venv/bin/python).
SPECSERVE_VLLM_MODEL picks the catalog model (default smollm2-135m-instruct); SPECSERVE_VLLM_RECORD,
when set, is the JSON file the run is recorded to (docs/benchmarks/gateway_vllm_rollout.json).
Takes 5-10 minutes on 2 cores (most of it vLLM's start-up). CI never runs it.
"""

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from specserve.cli import main
from tests.helpers.gateway_fleet import Traffic, wait_for

VLLM_PY = os.environ.get("SPECSERVE_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PY, reason="set SPECSERVE_VLLM_PYTHON to a python "
                                                                          "with vLLM to run the vLLM fleet test")]
MODEL = os.environ.get("SPECSERVE_VLLM_MODEL", "smollm2-135m-instruct")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
TOKEN = "vllm-e2e"
PROMPTS = ["Count from one to twenty: one, two, three, four,", "List the days of the week: Monday, Tuesday,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_copy(src: Path, dst: Path) -> Path:
    """Links to the converted model with `architectures` in config.json (vLLM needs it to pick a causal LM)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg["model_type"]]
    cfg.setdefault("architectures", [arch])
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _vllm(model_dir: Path, port: int, core: str, log: Path, spec: dict | None) -> subprocess.Popen:
    cmd = [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           MODEL, "--dtype", "float32", "--max-num-batched-tokens", "512", "--max-model-len", "1024",
           "--host", "127.0.0.1", "--port", str(port)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _healthy(url: str, proc: subprocess.Popen, log: Path) -> bool:
    if proc.poll() is not None:
        pytest.fail(f"vLLM exited: {log.read_text()[-3000:]}")
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_vllm_fleet_rollout_and_bench(real_model, tmp_path):
    model_dir = _model_copy(real_model(MODEL).path, tmp_path / "model")
    ports = {"baseline": _free_port(), "ngram": _free_port()}
    logs = {n: tmp_path / f"vllm-{n}.log" for n in ports}
    t_start = time.monotonic()
    procs = {"baseline": _vllm(model_dir, ports["baseline"], "0", logs["baseline"], None),
             "ngram": _vllm(model_dir, ports["ngram"], "1", logs["ngram"], NGRAM)}
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    record: dict = {"model": MODEL, "vllm_speculative_config": NGRAM}
    gw = None
    try:
        for n in procs:
            wait_for(lambda n=n: _healthy(urls[n], procs[n], logs[n]), timeout_s=900, step_s=2)
        record["vllm_startup_s"] = round(time.monotonic() - t_start, 1)
        from specserve.gateway.app import create_gateway_app
        from specserve.gateway.config import fleet_from_dict
        from specserve.server.launcher import ServerThread

        plan = {"candidate": "ngram", "steps": [50, 100], "min_dwell_s": 0, "min_requests": 4, "window_s": 300,
                "interval_s": 1, "shadow": {"sample": 1.0, "max_in_flight": 1},
                "gates": {"p95_e2e_ratio": 2.0, "p95_ttft_ratio": None, "median_tpot_ratio": 1.5,
                          "error_rate_diff": 0.0, "min_mean_acceptance_length": 1.0}}
        cfg = fleet_from_dict({
            "backends": [{"name": "vllm-base", "url": urls["baseline"], "profile": "baseline", "kind": "vllm"},
                         {"name": "vllm-ngram", "url": urls["ngram"], "profile": "ngram", "kind": "vllm"}],
            "profiles": {"ngram": NGRAM}, "admin_token": TOKEN, "allow_profile_override": True,
            "request_log": str(tmp_path / "gw.jsonl"), "health": {"interval_s": 1, "timeout_s": 2},
            "rollout": {"plan": plan}})
        gw = ServerThread(create_gateway_app(cfg, seed=0)).start()
        auth = {"authorization": f"Bearer {TOKEN}"}
        t0 = time.monotonic()
        with Traffic(gw.base_url, PROMPTS, max_tokens=32, n_threads=1, timeout_s=300) as traffic:
            st = wait_for(lambda: (s := httpx.get(gw.base_url + "/admin/rollout", headers=auth).json())["state"]
                          in ("completed", "reverted") and s, timeout_s=900, step_s=1)
        codes = traffic.codes
        record["rollout"] = {"seconds": round(time.monotonic() - t0, 1), "state": st["state"],
                             "history": st["history"], "last_evaluation": st["last_evaluation"],
                             "client_status_codes": {str(c): codes.count(c) for c in set(codes)}}
        out = tmp_path / "bench"
        assert main(["bench", "--base-url", gw.base_url + "/v1", "--dataset", "code,edit", "--num-prompts", "4",
                     "--max-tokens", "64", "--profile", "baseline", "ngram", "--warmup", "1", "--no-progress",
                     "--output-dir", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        record["bench"] = {"args": "--dataset code,edit --num-prompts 4 --max-tokens 64 --profile baseline ngram "
                                   "--warmup 1 (through the gateway)",
                           "runs": [{"profile": r["profile"], "load": r["load"],
                                     **{k: r["overall"].get(k) for k in (
                                         "num_requests", "error_rate", "output_tps", "tpot_ms_p50", "ttft_ms_p50",
                                         "e2e_ms_p50", "mean_acceptance_length", "acceptance_rate",
                                         "acceptance_source")}} for r in summary["runs"]],
                           "comparisons": [{"candidate": c["candidate"], "speedup": c["overall"].get("speedup"),
                                            "greedy_match": c["overall"].get("greedy_match")}
                                           for c in summary["comparisons"]]}
        # the gateway writes a request's log line after its answer's last byte (and shadow replays may still run):
        # stop it first, so that its request log is whole and closed when read
        gw.stop()
        gw_lines = [json.loads(x) for x in (tmp_path / "gw.jsonl").read_text().splitlines()]
        record["gateway_requests"] = len(gw_lines)
        record["gateway_backends_used"] = sorted({x["backend"] for x in gw_lines if x.get("backend")})
        assert st["state"] == "completed", st["reason"]
        assert set(codes) == {200}
        assert {"vllm-base", "vllm-ngram"} <= set(record["gateway_backends_used"])
        assert all(r["error_rate"] == 0 for r in record["bench"]["runs"])
    finally:
        if os.environ.get("SPECSERVE_VLLM_RECORD"):
            record["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
            Path(os.environ["SPECSERVE_VLLM_RECORD"]).write_text(json.dumps(record, indent=1, default=str) + "\n")
        if gw is not None:
            gw.stop()  # (a second stop of a stopped gateway returns at once)
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
