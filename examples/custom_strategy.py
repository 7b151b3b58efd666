"""Register a strategy of your own and use it like the built-ins.

    python examples/custom_strategy.py

A package can make it available to everyone by declaring an entry point:

    [project.entry-points."posextend.strategies"]
    mirror = "my_package.strategies"
"""

import torch

import posextend


@posextend.register_strategy("mirror", description="Reflect the table at its end (no discontinuity).")
def mirror(table: torch.Tensor, new_len: int, *, generator: torch.Generator) -> torch.Tensor:
    n = table.shape[0]
    idx = torch.arange(new_len) % (2 * n)
    return table[torch.where(idx < n, idx, 2 * n - 1 - idx)]


table = torch.randn(512, 64)
new = posextend.resize_table(table, 2048, "mirror")
print("strategies:", ", ".join(posextend.available_strategies()))
print("resized", tuple(table.shape), "->", tuple(new.shape), "row 512 == row 511:", torch.equal(new[512], table[511]))
