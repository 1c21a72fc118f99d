"""The golden set of `pdserve contract`: the built-in default and operator YAML files.

A cases file is a YAML mapping with these keys (only `prompts` is required):

    prompts:            # completion prompts, each run greedily on both servers
      - "The capital of France is"
    eos_question: "What is the capital of France?"   # a chat turn the model ends by EOS
    max_tokens: 16      # tokens per greedy completion
    top_logprobs: 5     # k of the top-k logprobs contract
    logprob_atol: 0.001 # |baseline - candidate| allowed per logprob (see Cases)
    n: 3                # choices of the n > 1 contract
    seed: 1234          # seed of the sampling contracts
    abort_streams: 4    # streams opened and closed early by the abort contract
    burst: 4            # concurrent requests timed before and after the aborts

This module knows nothing about HTTP or the contracts themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

_TRAVEL = (
    "You are a helpful assistant for a travel agency. Answer briefly and precisely. "
    "The customer is planning a trip through Europe in the spring and asks about cities. "
)


@dataclass(frozen=True)
class Cases:
    prompts: tuple[str, ...]
    eos_question: str = "What is the capital of France?"
    max_tokens: int = 16
    top_logprobs: int = 5
    # Same weights, same dtype: the two servers differ only in batch shapes and kernel
    # reduction order. In float32 that moves a logprob by ~1e-6, so 1e-3 leaves three
    # orders of margin and still catches a wrong softmax or temperature (>= 1e-2). bf16
    # deployments round logits to ~3 significant digits: use ~5e-2 there.
    logprob_atol: float = 1e-3
    n: int = 3
    seed: int = 1234
    abort_streams: int = 4
    burst: int = 4

    def __post_init__(self) -> None:
        if not self.prompts or not all(isinstance(p, str) and p for p in self.prompts):
            raise ValueError("'prompts' must be a non-empty list of non-empty strings")
        if not isinstance(self.eos_question, str) or not self.eos_question:
            raise ValueError("'eos_question' must be a non-empty string")
        for name in ("max_tokens", "top_logprobs", "n", "abort_streams", "burst"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"'{name}' must be an integer >= 1, got {v!r}")
        if self.n < 2:
            raise ValueError("'n' must be >= 2 (it tests n > 1)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"'seed' must be an integer, got {self.seed!r}")
        if not isinstance(self.logprob_atol, (int, float)) or not self.logprob_atol > 0:
            raise ValueError(f"'logprob_atol' must be a number > 0, got {self.logprob_atol!r}")


DEFAULT_CASES = Cases(
    prompts=(
        _TRAVEL + "Name three cities:",
        "The capital of France is",
        "def fibonacci(n):",
        "1, 2, 3, 4, 5,",
    )
)


def load_cases(spec: str) -> Cases:
    """`default` or a YAML file; ValueError naming the file and the rule it breaks."""
    if spec == "default":
        return DEFAULT_CASES
    import yaml

    path = Path(spec)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"--cases {spec}: cannot read: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"--cases {spec}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"--cases {spec}: must be a YAML mapping with at least 'prompts'")
    known = {f.name for f in fields(Cases)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--cases {spec}: unknown keys {unknown}; known: {sorted(known)}")
    if "prompts" not in data:
        raise ValueError(f"--cases {spec}: 'prompts' is required")
    if not isinstance(data["prompts"], list):
        raise ValueError(f"--cases {spec}: 'prompts' must be a list of strings")
    try:
        return Cases(**dict(data, prompts=tuple(data["prompts"])))
    except ValueError as e:
        raise ValueError(f"--cases {spec}: {e}") from e
