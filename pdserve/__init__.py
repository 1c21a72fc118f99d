"""pdserve: disaggregated prefill/decode LLM serving.

The public offline API is re-exported here: `from pdserve import LLM, SamplingParams`.
Imports are lazy so that `import pdserve` (for the CLI's --help) stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.source_tree import keep_root_off_path
from pdserve.version import __version__

keep_root_off_path()  # before anything imports transformers (pdserve/source_tree.py)

if TYPE_CHECKING:
    from pdserve.runner.beam_search import BeamSearchParams
    from pdserve.runner.llm import LLM
    from pdserve.runner.lora.request import LoRARequest
    from pdserve.runner.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
    )
    from pdserve.runner.pooling import PoolingParams
    from pdserve.runner.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "LoRARequest",
    "PoolingParams",
    "SamplingParams",
    "RequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]

_LAZY = {
    "LLM": "pdserve.runner.llm",
    "BeamSearchParams": "pdserve.runner.beam_search",
    "LoRARequest": "pdserve.runner.lora.request",
    "SamplingParams": "pdserve.runner.sampling_params",
    "RequestOutput": "pdserve.runner.outputs",
    "CompletionOutput": "pdserve.runner.outputs",
    "Logprob": "pdserve.runner.outputs",
    "EmbeddingRequestOutput": "pdserve.runner.outputs",
    "ClassificationRequestOutput": "pdserve.runner.outputs",
    "PoolingParams": "pdserve.runner.pooling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
