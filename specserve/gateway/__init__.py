"""The gateway: an OpenAI-compatible front over a fleet of specserve / vLLM / OpenAI-compatible servers
(`config.py` fleet file, `backends.py` health, `proxy.py` forwarding, `metrics.py`, `app.py`)."""
