"""`PSTableView`: the `<collection>.<table>` submodule of a BagPipe table.

It holds no rows: a placeholder parameter (so TorchRec's optimizer filters and module tree
see the table) and the table's state-dict entry, a live view of the PS that its owner
(`BagPipeTables`, through `TableAccess`) reads and writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torchrec.optim.fused import EmptyFusedOptimizer

__all__ = ["PSTableView", "TableAccess"]


class TableAccess(Protocol):
    """How a view reaches its table's values (`BagPipeTables`)."""

    def table_weight(self, table: str) -> torch.Tensor:
        """The table's weights: a live row-wise ShardedTensor of PS views."""
        ...

    def table_shape(self, table: str) -> tuple[int, int]: ...

    def write_table(self, table: str, value: torch.Tensor) -> None:
        """A state-dict load of the table (this rank's rows of `value`)."""
        ...


class PSTableView(nn.Module):
    """`<collection>.<table>` of a BagPipe table: a placeholder `weight` plus state-dict
    access to the PS.

    The placeholder is an empty (0, dim) parameter that carries `_in_backward_optimizers`
    (so TorchRec's `in_backward_optimizer_filter` keeps it out of the dense optimizer) and
    never receives a gradient; the table's values are read from / written to the PS through
    the owner's `TableIO`.
    """

    def __init__(self, owner: TableAccess, table: str, dim: int,
                 device: torch.device) -> None:
        super().__init__()
        # A plain attribute, not a submodule: the owner is no module, and the sharded module
        # that holds both must not become a cycle in the module tree.
        object.__setattr__(self, "_owner", owner)
        self._table = table
        weight = nn.Parameter(torch.empty(0, dim, device=device), requires_grad=False)
        weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        self.weight = weight

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        # A row-wise ShardedTensor of live PS views (table_state.py): nothing is read here.
        # A virtual table has none (its id space is no tensor): docs/virtual_tables.md.
        if self._table in getattr(self._owner, "virtual_tables", ()):
            return
        destination[prefix + "weight"] = self._owner.table_weight(self._table)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Any, strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "weight"
        if self._table in getattr(self._owner, "virtual_tables", ()):
            return  # no state-dict entry (above)
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        shape = self._owner.table_shape(self._table)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {got}, the BagPipe "
                f"table {self._table!r} has shape {shape}"
            )
            return
        self._owner.write_table(self._table, value)
