"""`full`: the uncompressed baseline; keeps every token."""

from torch import Tensor

from kvmem.compress.base import HeadView, Method


class Full(Method):
    name = "full"

    def score(self, head: HeadView) -> Tensor:
        raise AssertionError("compress() never scores with `full`: it keeps everything")
