"""Layer-wise pipelining of a prefix load: layer i+1's stored rows are verified, decoded and put in place while the
model's forward runs layer i.

Without it a warm request waits for every chunk to be verified, decoded and imported before its forward starts (at
8k tokens of SmolLM2 from memory: ~0.11 s decoding and ~0.15 s importing, then a ~0.34 s forward over the question).
But the forward reads layer i's cache only when it reaches layer i, and each layer of a stored chunk carries its own
digest (`store/chunk.py`). So a loader thread takes the layers in order, for each every chunk's rows of it (verify,
decode, check, join into the layer's storage: `import_layer`), while the forward runs; a layer the forward
reaches before its rows are in place waits for them (`KVLayer.arrival`).

A layer that fails verification stops the forward before anything reads it (`LayerFailed`, raised in the forward
when it reaches that layer); the caller rejects the chunk and prefills again without it (`prefix.prefill`). What the
forward computed from earlier layers is thrown away with the cache.

    loader = LayerLoader(cache, opened, next_position, spare)   # opened: the chunks' `store.Opened`, in order
    try:
        logits = feed(lm, cache, rest)                         # waits for each layer as it reaches it
    finally:
        loader.close()                                         # joins the thread; removes the waits
"""

from __future__ import annotations

import threading
import time

import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.rows import DenseExport, ExportedRows


class LayerFailed(KVMemError):
    """A stored chunk's layer failed verification while the forward that needs it was under way."""

    def __init__(self, opened, error: Exception):
        super().__init__(f"stored chunk {opened.key[:12]} failed verification ({error})")
        self.opened, self.error = opened, error


class LayerLoader:
    """Puts the rows of `opened` (consecutive chunks, header-verified) into the empty `cache`, layer by layer, in a
    thread; decoding continues at `next_position` with `spare` free rows a layer."""

    def __init__(self, cache: KVCache, opened: list, next_position: int, spare: int):
        if any(layer.is_initialized for layer in cache.layers):
            raise KVMemError("stored chunks load into an empty cache only")
        self.cache, self.opened, self.next_position, self.spare = cache, opened, next_position, spare
        self.ready = [threading.Event() for _ in cache.layers]
        self.imported = 0  # layers in place, in order (only the loader writes it)
        self.failure: tuple[object, BaseException] | None = None  # (the chunk or None, the error)
        self.import_s = self.wait_s = 0.0
        self._stop = False
        for l, layer in enumerate(cache.layers):
            layer.arrival = lambda l=l: self._arrive(l)
        self._thread = threading.Thread(target=self._run, name="kvmem-layers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for l, layer in enumerate(self.cache.layers):
                if self._stop:
                    return
                pieces = []
                for opened in self._needed(layer):
                    try:
                        pieces.append(opened.layer(l))
                    except KVMemError as e:
                        self.failure = (opened, e)
                        return
                t = time.perf_counter()
                import_layer(layer, pieces, self.next_position, self.spare)
                self.import_s += time.perf_counter() - t
                self.imported = l + 1
                self.ready[l].set()
        except BaseException as e:  # noqa: BLE001 - surfaced in the forward, which would otherwise wait for ever
            self.failure = (None, e)
        finally:
            for event in self.ready:  # wake every waiter: it sees from `imported` whether its layer came
                event.set()

    def _needed(self, layer) -> list:
        """The chunks whose rows of `layer` it keeps: all, or for a sliding layer those with a position the next token
        can see (> next_position - window). The others' rows of it are neither verified nor decoded: never read (on
        Gemma-3 at 16k tokens, 15 of 18 layers keep 511 rows of 16k)."""
        if not layer.is_sliding:
            return self.opened
        first = self.next_position - layer.sliding_window + 1
        return [o for o in self.opened if o.start + o.tokens > first]

    def _arrive(self, l: int) -> None:
        """Called by layer l before the forward reads it: wait for its rows, or raise what stopped the loader."""
        if not self.ready[l].is_set():
            t = time.perf_counter()
            self.ready[l].wait()
            self.wait_s += time.perf_counter() - t
        if l >= self.imported:
            opened, error = self.failure or (None, KVMemError("the layer loader stopped"))
            if opened is None:
                raise error
            raise LayerFailed(opened, error)
        self.cache.layers[l].arrival = None

    def wait_all(self) -> None:
        """Wait until every layer is in place (raises as the forward would if one failed)."""
        for l, layer in enumerate(self.cache.layers):
            if layer.arrival is not None:
                self._arrive(l)

    def close(self) -> None:
        """Stop the loader (if the forward ended early) and wait for it; the layers no longer wait."""
        self._stop = True
        self._thread.join()
        for layer in self.cache.layers:
            layer.arrival = None


def import_chunks(cache: KVCache, chunks: list[list[ExportedRows]], next_position: int, spare: int = 0) -> None:
    """Put the rows of consecutive chunks into an empty cache; decoding continues at `next_position`. A sliding
    layer keeps what the next token can see (positions > next_position - window), as if it had computed them.
    `spare`: free rows for the tokens the caller feeds next (no regrowth of the loaded rows to append them)."""
    if any(layer.is_initialized for layer in cache.layers):
        raise KVMemError("stored chunks load into an empty cache only")
    for l, layer in enumerate(cache.layers):
        import_layer(layer, [c[l] for c in chunks], next_position, spare)


def import_layer(layer, pieces: list[ExportedRows], next_position: int, spare: int) -> None:
    """One layer's rows of consecutive chunks into the (empty) layer (`import_chunks`)."""
    rows = None if layer.is_sliding else _joined_in_place(pieces, spare)
    adopt = rows is not None
    if rows is None:
        parts = [[p.heads[h] for p in pieces] for h in range(len(pieces[0].heads))]
        heads = []
        for head_parts in parts:
            head = {f: torch.cat([p[f] for p in head_parts]) for f in head_parts[0]}
            if layer.is_sliding:
                keep = (head["positions"] > next_position - layer.sliding_window).nonzero().flatten()
                head = {f: t.index_select(0, keep) for f, t in head.items()}
            heads.append(head)
        rows = ExportedRows(heads)
    layer.import_rows(rows, next_position, spare, adopt)


def _joined_in_place(pieces: list[ExportedRows], spare: int) -> ExportedRows | None:
    """One layer's chunks joined straight into one (H, rows + spare, D) buffer per field, which the layer adopts as its
    storage (`rows.store_rows`): one copy of the loaded rows instead of two (at 8k tokens of SmolLM2, 378 MB and its
    page faults). Chunks decoded as `DenseExport` are read as their (H, T, D) tensors (no per-head dicts are made).
    None where heads differ in length or carry more than keys, values and positions."""
    if all(isinstance(p, DenseExport) for p in pieces) and len({p.keys.shape[::2] for p in pieces}) == 1:
        n = sum(p.keys.shape[1] for p in pieces)
        buffers = {f: torch.empty((t.shape[0], n + spare, *t.shape[2:]), dtype=t.dtype)
                   for f, t in (("keys", pieces[0].keys), ("values", pieces[0].values), ("positions", pieces[0].positions))}
        for f, buffer in buffers.items():
            torch.cat([getattr(p, f) for p in pieces], dim=1, out=buffer[:, :n])
        return ExportedRows([{f: buffer[h, :n] for f, buffer in buffers.items()} for h in range(buffers["keys"].shape[0])])
    parts = [[p.heads[h] for p in pieces] for h in range(len(pieces[0].heads))]
    if any(set(p) != {"keys", "values", "positions"} for head in parts for p in head):
        return None
    n = {sum(p["positions"].shape[0] for p in head) for head in parts}
    if len(n) != 1:
        return None
    n = n.pop()
    buffers = {f: torch.empty((len(parts), n + spare, *parts[0][0][f].shape[1:]), dtype=parts[0][0][f].dtype)
               for f in ("keys", "values", "positions")}
    for h, head in enumerate(parts):
        for f, buffer in buffers.items():
            torch.cat([p[f] for p in head], out=buffer[h, :n])
    return ExportedRows([{f: buffer[h, :n] for f, buffer in buffers.items()} for h in range(len(parts))])
