"""What a request constrains its output to (vLLM's `StructuredOutputsParams`), and its DFA.

One of: `json` (a JSON schema, as JSON text so it travels and hashes as one string; its
property order is kept, since the output follows it), `regex`, `choice` (one of these
strings, exactly), `grammar` (GBNF text: `ebnf_parse.py`), `structural_tag` (JSON text:
free text with structures after triggers, `structural_tag.py`) or `json_object` (any
JSON object: OpenAI's JSON mode). The router compiles the byte DFA (`patterns.py`) to
refuse a bad pattern with a 400 before anything runs; each worker compiles it again
(cached by `key`) and lifts it to its tokenizer (`token_table.py`).

`reasoning` is set by the server, never the client: with a `<think>`-tag reasoning
parser (`--reasoning-parser`), the reply may reason first and the constraint holds what
follows the block, as on vLLM (`patterns.after_reasoning`). It is (open tag, close tag,
whether the reply opens inside the block).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

MAX_CHOICES = 1024
MAX_PATTERN_CHARS = 64 << 10
FIELDS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")  # a flag last


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False
    grammar: str | None = None
    structural_tag: str | None = None
    reasoning: tuple[str, str, bool] | None = None

    def __post_init__(self) -> None:
        given = [n for n in FIELDS[:-1] if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(FIELDS)} "
                f"(got {given or 'none'})"
            )
        for name in ("json", "structural_tag"):  # objects travel as their JSON text
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, json.dumps(value))
        if self.choice is not None:
            choice = self.choice
            if not (
                isinstance(choice, (list, tuple))
                and 0 < len(choice) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in choice)
            ):
                raise ValueError(
                    f"structured_outputs choice must be 1 to {MAX_CHOICES} non-empty strings "
                    f"(got {choice!r})"
                )
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs {name} must be a string (got {value!r})")
        if self.reasoning is not None:
            r = self.reasoning
            if not (
                isinstance(r, (list, tuple)) and len(r) == 3
                and isinstance(r[0], str) and r[0] and isinstance(r[1], str) and r[1]
                and isinstance(r[2], bool)
            ):  # fmt: skip
                raise ValueError(
                    f"structured_outputs reasoning must be (open, close, opens) (got {r!r})"
                )
            object.__setattr__(self, "reasoning", tuple(r))
        if len(self.key) > MAX_PATTERN_CHARS:
            raise ValueError(f"structured_outputs is longer than {MAX_PATTERN_CHARS} characters")

    @property
    def key(self) -> str:
        """One string per constraint: the caches' key and the wire form's content."""
        return json.dumps(self.to_wire(), ensure_ascii=False)

    def to_wire(self) -> dict[str, Any]:
        wire = self._constraint()
        if self.reasoning is not None:
            wire["reasoning"] = list(self.reasoning)
        return wire

    def _constraint(self) -> dict[str, Any]:
        if self.json is not None:
            return {"json": self.json}
        if self.regex is not None:
            return {"regex": self.regex}
        if self.choice is not None:
            return {"choice": list(self.choice)}
        if self.grammar is not None:
            return {"grammar": self.grammar}
        if self.structural_tag is not None:
            return {"structural_tag": self.structural_tag}
        return {"json_object": True}

    @classmethod
    def from_wire(cls, body: Any) -> StructuredOutputs:
        if not isinstance(body, dict):
            raise ValueError(f"structured_outputs must be a map with one of {', '.join(FIELDS)}")
        unknown = sorted(set(body) - set(FIELDS) - {"reasoning"})
        if unknown:
            raise ValueError(
                f"structured_outputs field(s) {unknown} are not supported here (supported: "
                f"{', '.join(FIELDS)})"
            )
        choice = body.get("choice")
        return cls(
            json=body.get("json"),
            regex=body.get("regex"),
            choice=tuple(choice) if isinstance(choice, list) else choice,
            json_object=body.get("json_object") is True,
            grammar=body.get("grammar"),
            structural_tag=body.get("structural_tag"),
            reasoning=body.get("reasoning"),
        )

    def after_reasoning(self, open_tag: str, close_tag: str, opens: bool) -> StructuredOutputs:
        """This constraint on what follows a reasoning block (see the module docstring)."""
        return dataclasses.replace(self, reasoning=(open_tag, close_tag, opens))

    def describe(self) -> str:
        """A short name for logs and errors."""
        return next(iter(self._constraint()))
