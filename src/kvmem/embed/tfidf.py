"""`tfidf`: the lexical retrieval baseline (Salton & Buckley 1988), scikit-learn's `TfidfVectorizer`.

Unlike the other methods it must be fitted: `fit(docs)` learns the vocabulary and IDF weights *on the
documents being searched* (the retrieval benchmark does this; queries are only transformed). Vectors are
sublinear-TF, L2-normalised, English stop words removed; dim = the vocabulary size of the fitted corpus.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from kvmem.embed.base import Embedder
from kvmem.errors import KVMemError


class TfIdf(Embedder):
    name = "tfidf"

    def __init__(self):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.vectorizer = TfidfVectorizer(sublinear_tf=True, stop_words="english")
        self.fitted = False

    def fit(self, docs: Sequence[str]) -> "TfIdf":
        if not docs:
            raise KVMemError("tfidf needs documents to fit on; got none")
        self.vectorizer.fit(list(docs))
        self.fitted = True
        return self

    def _embed(self, texts: list[str]) -> Tensor:
        if not self.fitted:
            raise KVMemError("tfidf must be fitted on the documents first: call fit(docs)")
        return torch.from_numpy(self.vectorizer.transform(texts).toarray()).float()
