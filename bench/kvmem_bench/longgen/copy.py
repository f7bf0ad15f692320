"""The copy task's prompts and its check, shared by the runner (which records outputs) and the report (which scores
them again, so a change to the check applies to every record)."""

from __future__ import annotations

import random
import re

from kvmem_bench.longctx.haystack import ADJECTIVES, NOUNS
from kvmem_bench.longgen import ITEMS

_NUMBERING = re.compile(r"^\s*(?:[-*]\s*)?\d+\s*[.):-]?\s*")  # "17. ", "17) ", "17 ", "- 17. " before an entry


def copy_sample(i: int) -> tuple[str, str, list[str]]:
    """The i-th copy prompt: (document, instruction, entries), the same on every tokenizer."""
    rng = random.Random(f"copy:{i}")
    entries: list[str] = []
    while len(entries) < ITEMS:
        entry = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}: {rng.randrange(1000, 10000)}"
        if entry not in entries:
            entries.append(entry)
    document = "Inventory list:\n" + "\n".join(f"{k + 1}. {e}" for k, e in enumerate(entries))
    instruction = f"Copy the inventory list above exactly, every line in order, from 1 to {ITEMS}. Write nothing else."
    return document, instruction, entries


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


def copy_score(entries: list[str], output: str) -> float:
    """Fraction of `entries` written as an output line (its numbering aside, however written; case and spaces
    ignored). An entry with a wrong name or number does not count."""
    lines = {_norm(_NUMBERING.sub("", line)) for line in output.splitlines()}
    return sum(_norm(e) in lines for e in entries) / len(entries)
