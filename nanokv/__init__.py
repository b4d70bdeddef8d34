"""nanokv: a small, readable LLM inference engine whose KV cache is run like a memory system."""

from nanokv.config import EngineConfig
from nanokv.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model; import it lazily so `nanokv.cache_service` stays torch-free.
    if name == "LLM":
        from nanokv.gateway.llm import LLM
        return LLM
    raise AttributeError(name)
