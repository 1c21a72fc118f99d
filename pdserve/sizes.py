"""Human-readable integers for size flags, with vLLM's meaning of the suffixes.

`--max-model-len 32k`, `--max-num-batched-tokens 8K`, `--kv-cache-memory-bytes 4G`: a lower
case suffix is decimal (k = 1,000, m = 10**6, g = 10**9, t = 10**12) and may follow a
decimal number (`25.6k` = 25,600); an upper case one is binary (K = 1,024, M = 2**20,
G = 2**30, T = 2**40) and takes a whole number only. A plain integer is itself.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal

DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def parse_size(text: str | int) -> int:
    """`text` as an integer; ValueError naming the accepted forms if it is none of them."""
    if isinstance(text, bool):
        raise ValueError(f"expected an integer or a size like 4G, got {text!r}")
    if isinstance(text, int):
        return text
    if not isinstance(text, str):
        raise ValueError(f"expected an integer or a size like 4G, got {text!r}")
    value = text.strip()
    match = _SIZE.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise ValueError(
                f"{text!r} is not an integer or a size (e.g. 4096, 32k = 32,000, "
                "32K = 32,768, 4G = 4 GiB)"
            ) from None
    number, suffix = match.groups()
    if suffix in BINARY:
        if "." in number:
            raise ValueError(
                f"{text!r}: a binary suffix ({suffix}) takes a whole number; "
                f"{number}{suffix.lower()} is the decimal size"
            )
        return int(number) * BINARY[suffix]
    exact = Decimal(number) * DECIMAL[suffix]  # exact: float would make 2.3k 2,299
    if exact != exact.to_integral_value():
        raise ValueError(f"{text!r} is {exact}, not a whole number")
    return int(exact)


def size_arg(text: str) -> int:
    """`parse_size` as an argparse type (its error becomes argparse's usage message)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
