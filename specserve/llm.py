"""Offline batch generation, shaped like vLLM's `LLM` so its users know it.

    from specserve import LLM, SamplingParams
    llm = LLM(model="qwen2.5-coder-0.5b-instruct", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    print(out[0].outputs[0].text)

What it does: builds an `LLMEngine`, feeds it all prompts at once (continuous batching does the rest),
sums each request's step deltas (`OutputAccumulator`) and returns the results in prompt order. What it does not do: serve over HTTP (`specserve.server`).
"""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from specserve.config import EngineConfig, SpeculativeConfig
from specserve.engine.llm_engine import USE_ENGINE_DEFAULT, LLMEngine
from specserve.outputs import GenerationOutput, OutputAccumulator
from specserve.sampling_params import SamplingParams


class LLM:
    """An engine for offline use.

    Args:
        model: catalog name, Hugging Face folder or .gguf path.
        speculative_config: vLLM-shaped dict (or SpeculativeConfig) used by every request by default.
        **kwargs: other EngineConfig fields (dtype, device, max_model_len, max_num_seqs, ...).

    Raises:
        ConfigError, ModelError: see LLMEngine.
    """

    def __init__(self, model: str, speculative_config: dict | SpeculativeConfig | None = None, **kwargs: Any):
        spec_config = speculative_config
        if isinstance(spec_config, dict):
            spec_config = SpeculativeConfig.from_dict(spec_config)
        self.engine = LLMEngine(EngineConfig(model=model, speculative_config=spec_config, **kwargs))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        speculative_config: dict | SpeculativeConfig | None = USE_ENGINE_DEFAULT,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; one GenerationOutput per prompt, in order.

        Args:
            prompts: a string, strings, or token id lists.
            sampling_params: one for all prompts or one per prompt (default: SamplingParams()).
            speculative_config: override the engine default for these requests (None = no speculation).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        plist = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        spec_config = SpeculativeConfig.from_dict(speculative_config) if isinstance(speculative_config, dict) else speculative_config
        return self._run(prompts, plist, spec_config, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[GenerationOutput]:
        """Like `generate`, for chat conversations (the model's chat template with a generation prompt)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.engine.encode_chat(c) for c in convs], sampling_params, **kwargs)

    def _run(self, prompts, plist, spec_config, use_tqdm) -> list[GenerationOutput]:
        eng = self.engine
        groups: list[tuple[str, Any, list[str]]] = []
        try:
            for prompt, params in zip(prompts, plist):
                rid = str(self._next_id)
                self._next_id += 1
                children = []
                groups.append((rid, prompt, children))
                for i in range(params.n):
                    cid = f"{rid}-{i}" if params.n > 1 else rid
                    eng.add_request(cid, prompt, params.for_choice(i), speculative_config=spec_config)
                    children.append(cid)
        except Exception:  # a bad prompt: the ones already queued must not linger in the engine
            for _, _, children in groups:
                for cid in children:
                    eng.abort_request(cid)
            eng.step()  # report (and drop) the aborts
            raise
        accs = {cid: OutputAccumulator() for _, _, children in groups for cid in children}
        bar = tqdm(total=len(accs), desc="generate", disable=not use_tqdm)
        while eng.has_unfinished_requests():
            for out in eng.step():
                acc = accs.get(out.request_id)
                if acc is None:  # another caller's request on the same engine
                    continue
                acc.add(out)
                if out.finished:
                    bar.update(1)
        bar.close()
        results = []
        for rid, prompt, children in groups:
            comps = [accs[cid].completion(i) for i, cid in enumerate(children)]
            results.append(GenerationOutput(rid, prompt if isinstance(prompt, str) else None,
                                            accs[children[0]].prompt_token_ids, comps))
        return results
