"""specserve: an LLM inference server with speculative decoding built in.

Offline use mirrors vLLM: `from specserve import LLM, SamplingParams`.
"""

from specserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing the package must not load torch models
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)
