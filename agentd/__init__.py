"""agentd: a local LLM inference daemon for agents.

``from agentd import LLM, SamplingParams`` gives the offline API. Imports are lazy so that the
CLI (``agentd --help``) never pulls in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "EngineConfig",
           "__version__"]

if TYPE_CHECKING:
    from agentd.config import EngineConfig
    from agentd.engine.outputs import RequestOutput
    from agentd.engine.sampling_params import SamplingParams
    from agentd.llm import LLM
    from agentd.structured.params import StructuredOutputsParams

_LAZY = {
    "LLM": "agentd.llm",
    "SamplingParams": "agentd.engine.sampling_params",
    "StructuredOutputsParams": "agentd.structured.params",
    "RequestOutput": "agentd.engine.outputs",
    "EngineConfig": "agentd.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentd' has no attribute {name!r}")
