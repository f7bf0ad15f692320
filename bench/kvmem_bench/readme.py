"""The README's results blocks: each benchmark report regenerates its own, between an opening and a closing marker."""

from __future__ import annotations

from pathlib import Path


def replace_block(readme: Path, markers: tuple[str, str], body: str) -> None:
    """Put `body` (which starts with markers[0] and ends with markers[1]) where the README's block is, or append it."""
    text = readme.read_text()
    opening = markers[0].split(":")[0]  # a block whose opening line's wording changed is still found
    if opening in text and markers[1] in text:
        start, end = text.index(opening), text.index(markers[1]) + len(markers[1])
        text = text[:start] + body + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    readme.write_text(text)
