"""vLLM's structural tags, in both of xgrammar's forms, as pattern trees.

The first form (`structures` and `triggers`):

    {"type": "structural_tag",
     "structures": [{"begin": "<function=get_weather>", "schema": {...},
                     "end": "</function>"}],
     "triggers": ["<function="]}

is free text, except that where a trigger appears a structure follows (its `begin`, JSON
valid against its `schema`, its `end`), then free text again. It is the `triggered_tags`
format below with JSON-schema contents.

The `format` form nests formats:

- `const_string` {value}: exactly that text; `json_schema` {json_schema}; `regex`
  {pattern}; `any_text` {excludes}: any text in which none of `excludes` occurs, nor,
  anywhere inside a tag, the nearest enclosing tag's end (its first occurrence closes the
  tag);
- `sequence` / `or` {elements}: one after another / one of them;
- `optional` / `star` / `plus` {content}: 0 or 1 / any number / 1 or more times;
  `repeat` {content, min, max}: min to max times (max -1: no bound);
- `tag` {begin, content, end}: begin, the content's text, end (`end` may be a list: any
  one of them);
- `triggered_tags` {triggers, tags, at_least_one, stop_after_first, excludes}: free text
  in which no trigger occurs (nor one of `excludes`, nor, inside a tag, the nearest
  enclosing tag's end), except that each trigger starts one of the
  tags whose begin starts with it (each tag's begin starts with exactly one trigger).
  `at_least_one`: the text opens with a tag; `stop_after_first`: nothing follows the
  first tag.
- `tags_with_separator` {tags, separator, at_least_one, stop_after_first}: tags with the
  separator between them and no other text (possibly none; at least one; at most one).

    free (tag free)*                 triggered_tags
    tag free (tag free)*             ... at_least_one
    free tag?                        ... stop_after_first
    tag                              ... both
    free = Avoid(triggers + excludes + the nearest enclosing tag's ends)

(`response_format`, or `structured_outputs.structural_tag` as its JSON text.) Tool calls
in a model's own format and JSON after a reasoning model's `</think>` are what clients
use them for. The `grammar` format, the token-level formats, `dispatch`,
`qwen_xml_parameter` and the `max_tokens` / `max_chars` budgets are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.runner.structured.json_schema import schema_node
from pdserve.runner.structured.regex_ast import (
    Avoid,
    ByteSet,
    Node,
    Repeat,
    SepRepeat,
    alt,
    literal,
    optional,
    seq,
)
from pdserve.runner.structured.regex_parse import MAX_REPEAT, parse_regex

ANY_TEXT: Node = Repeat(ByteSet(frozenset(range(256))), 0, None)
MAX_FORMAT_DEPTH = 16  # nested formats (a tag in a sequence in a tag ...)
_KEYS = {"type", "structures", "triggers", "format"}
_STRUCTURE_KEYS = {"begin", "schema", "end"}
# format type -> the fields it takes (besides "type")
_FORMATS: dict[str, set[str]] = {
    "const_string": {"value"},
    "json_schema": {"json_schema", "style"},
    "regex": {"pattern"},
    "any_text": {"excludes"},
    "sequence": {"elements"},
    "or": {"elements"},
    "optional": {"content"},
    "star": {"content"},
    "plus": {"content"},
    "repeat": {"content", "min", "max"},
    "tag": {"begin", "content", "end"},
    "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first", "excludes"},
    "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
}


def structural_tag_node(text: str) -> Node:
    """The pattern tree of a structural tag given as JSON text; ValueError says what is
    wrong with it."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structural_tag is not valid JSON: {e}") from e
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be an object with 'format', or 'structures' and "
                         "'triggers'")  # fmt: skip
    unknown = sorted(set(tag) - _KEYS)
    if unknown:
        raise ValueError(f"structural_tag has unknown field(s) {unknown}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag's type must be 'structural_tag' (got {tag['type']!r})")
    if "format" in tag:
        if "structures" in tag or "triggers" in tag:
            raise ValueError("structural_tag takes 'format' or 'structures' and 'triggers', "
                             "not both")  # fmt: skip
        return _Formats().node(tag["format"], "structural_tag.format", (), 0)
    return _Formats("structures").node(_legacy(tag), "structural_tag", (), 0)


def _legacy(tag: dict) -> dict:
    """The first form as the `triggered_tags` format it means."""
    structures = tag.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag needs 'structures': a non-empty list")
    tags = []
    for i, s in enumerate(structures):
        where = f"structural_tag's structures[{i}]"
        if not isinstance(s, dict):
            raise ValueError(f"{where} must be an object with 'begin', 'schema' and 'end'")
        unknown = sorted(set(s) - _STRUCTURE_KEYS)
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {unknown}")
        if "schema" not in s:
            raise ValueError(f"{where} needs a 'schema' (a JSON schema; true for any JSON)")
        content = {"type": "json_schema", "json_schema": s["schema"]}
        tags.append({"type": "tag", "begin": s.get("begin"), "content": content,
                     "end": s.get("end")})  # fmt: skip
    return {"type": "triggered_tags", "triggers": tag.get("triggers"), "tags": tags}


class _Formats:
    """One structural tag's formats to pattern trees. `until`: the ends of the nearest tag
    a format is inside of (xgrammar's automatic end detection), which its free text
    (`any_text`, `triggered_tags`) never holds. `tags_field`: what errors call a tag list
    (the first form's is `structures`)."""

    def __init__(self, tags_field: str = "tags") -> None:
        self.tags_field = tags_field

    def node(self, fmt: Any, where: str, until: tuple[bytes, ...], depth: int) -> Node:
        if depth > MAX_FORMAT_DEPTH:
            raise ValueError(f"{where}: formats nest deeper than {MAX_FORMAT_DEPTH}")
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ValueError(f"{where} must be an object with a 'type'")
        kind = fmt["type"]
        if kind not in _FORMATS:
            raise ValueError(
                f"{where}: format type {kind!r} is not supported (supported: {', '.join(_FORMATS)})"
            )
        unknown = sorted(set(fmt) - _FORMATS[kind] - {"type"})
        if unknown:
            raise ValueError(f"{where} ({kind}) has unknown field(s) {unknown}")
        return getattr(self, "_" + kind)(fmt, where, until, depth + 1)

    def _const_string(self, fmt: dict, where: str, until, depth) -> Node:
        return literal(_string(fmt, "value", where, empty=True))

    def _json_schema(self, fmt: dict, where: str, until, depth) -> Node:
        if "json_schema" not in fmt:
            raise ValueError(f"{where} needs 'json_schema' (a JSON schema; true for any JSON)")
        if fmt.get("style", "json") != "json":
            raise ValueError(f"{where}: json_schema style {fmt['style']!r} is not supported")
        try:
            return schema_node(fmt["json_schema"])
        except ValueError as e:
            raise ValueError(f"{where}'s schema: {e}") from e

    def _regex(self, fmt: dict, where: str, until, depth) -> Node:
        try:
            return parse_regex(_string(fmt, "pattern", where))
        except ValueError as e:
            raise ValueError(f"{where}'s pattern: {e}") from e

    def _any_text(self, fmt: dict, where: str, until, depth) -> Node:
        stops = _excludes(fmt, where) + until
        return Avoid(stops) if stops else ANY_TEXT

    def _sequence(self, fmt: dict, where: str, until, depth) -> Node:
        elements = _list(fmt, "elements", where)
        return seq(*(self.node(e, f"{where}.elements[{i}]", until, depth)
                     for i, e in enumerate(elements)))  # fmt: skip

    def _or(self, fmt: dict, where: str, until, depth) -> Node:
        elements = _list(fmt, "elements", where)
        return alt(*(self.node(e, f"{where}.elements[{i}]", until, depth)
                     for i, e in enumerate(elements)))  # fmt: skip

    def _content(self, fmt: dict, where: str, until, depth) -> Node:
        if "content" not in fmt:
            raise ValueError(f"{where} needs a 'content' format")
        return self.node(fmt["content"], f"{where}.content", until, depth)

    def _optional(self, fmt: dict, where: str, until, depth) -> Node:
        return optional(self._content(fmt, where, until, depth))

    def _star(self, fmt: dict, where: str, until, depth) -> Node:
        return Repeat(self._content(fmt, where, until, depth), 0, None)

    def _plus(self, fmt: dict, where: str, until, depth) -> Node:
        return Repeat(self._content(fmt, where, until, depth), 1, None)

    def _repeat(self, fmt: dict, where: str, until, depth) -> Node:
        lo, hi = fmt.get("min"), fmt.get("max")
        if not _is_int(lo) or not _is_int(hi) or lo < 0 or not (hi == -1 or hi >= lo):
            raise ValueError(
                f"{where} needs integers 'min' >= 0 and 'max' >= min, or max -1 for no bound "
                f"(got min {lo!r}, max {hi!r})"
            )
        if max(lo, hi) > MAX_REPEAT:
            raise ValueError(f"{where}: repeat counts are limited to {MAX_REPEAT} (got {lo}..{hi})")
        return Repeat(self._content(fmt, where, until, depth), lo, None if hi == -1 else hi)

    def _tag(self, fmt: dict, where: str, until, depth) -> Node:
        return self._tag_parts(fmt, where, depth)[0]

    def _tag_parts(self, fmt: Any, where: str, depth: int) -> tuple[Node, str]:
        """A tag's tree and its begin."""
        if not isinstance(fmt, dict) or fmt.get("type", "tag") != "tag":
            raise ValueError(f"{where} must be a tag: {{'begin', 'content', 'end'}}")
        unknown = sorted(set(fmt) - _FORMATS["tag"] - {"type"})
        if unknown:
            raise ValueError(f"{where} (tag) has unknown field(s) {unknown}")
        begin = _string(fmt, "begin", where)
        ends = fmt.get("end")
        ends = [ends] if isinstance(ends, str) else ends
        if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
            raise ValueError(f"{where} needs 'end': a string or a non-empty list of strings")
        if "content" not in fmt:
            raise ValueError(f"{where} needs a 'content' format")
        stops = tuple(e.encode() for e in ends if e)
        content = self.node(fmt["content"], f"{where}.content", stops, depth)
        return seq(literal(begin), content, alt(*(literal(e) for e in ends))), begin

    def _tags(self, fmt: dict, where: str, depth: int) -> list[tuple[Node, str]]:
        return [self._tag_parts(t, f"{where}.{self.tags_field}[{i}]", depth)
                for i, t in enumerate(_list(fmt, "tags", where))]  # fmt: skip

    def _triggered_tags(self, fmt: dict, where: str, until, depth) -> Node:
        triggers = _list(fmt, "triggers", where)
        if not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{where}'s 'triggers' must be non-empty strings (got {triggers!r})")
        tags = self._tags(fmt, where, depth)
        for i, (_, begin) in enumerate(tags):
            starts = [t for t in triggers if begin.startswith(t)]
            if len(starts) != 1:
                raise ValueError(
                    f"{where}.{self.tags_field}[{i}]'s begin {begin!r} starts with {len(starts)} of the "
                    f"triggers {triggers!r}; each tag's begin must start with exactly one"
                )
        free = Avoid(tuple(t.encode() for t in triggers) + _excludes(fmt, where) + until)
        tag = alt(*(node for node, _ in tags))
        first, once = _flag(fmt, "at_least_one", where), _flag(fmt, "stop_after_first", where)
        if first and once:
            return tag
        if once:
            return seq(free, optional(tag))
        rest = Repeat(seq(tag, free), 0, None)
        return seq(tag, free, rest) if first else seq(free, rest)

    def _tags_with_separator(self, fmt: dict, where: str, until, depth) -> Node:
        tag = alt(*(node for node, _ in self._tags(fmt, where, depth)))
        sep = literal(_string(fmt, "separator", where, empty=True))
        first, once = _flag(fmt, "at_least_one", where), _flag(fmt, "stop_after_first", where)
        some = tag if once else SepRepeat(tag, sep)
        return some if first else optional(some)


def _string(fmt: dict, name: str, where: str, empty: bool = False) -> str:
    value = fmt.get(name)
    if not isinstance(value, str) or not (value or empty):
        raise ValueError(f"{where} needs '{name}': a {'' if empty else 'non-empty '}string")
    return value


def _list(fmt: dict, name: str, where: str) -> list:
    value = fmt.get(name)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} needs '{name}': a non-empty list")
    return value


def _excludes(fmt: dict, where: str) -> tuple[bytes, ...]:
    value = fmt.get("excludes", [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(
            f"{where}'s 'excludes' must be a list of non-empty strings (got {value!r})"
        )
    return tuple(v.encode() for v in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(fmt: dict, name: str, where: str) -> bool:
    value = fmt.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}'s '{name}' must be a boolean (got {value!r})")
    return value
