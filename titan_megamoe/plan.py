"""The routing plan: the one contract between a dispatcher and the expert kernels.

A plan covers N expert rows. Row n comes from a source tensor (`RowSource`):
  GATHER      local tokens: row n = t*K + k reads token t = n // K of x (K = `rows_per_token`);
  CONTIGUOUS  a buffer of rows already in place (rows an EP dispatcher received): row n reads row n.
Both are the same indexing with rows_per_token = K or 1, so the kernels never branch on the source.

Row n goes to local expert `expert_ids[n] - first_expert` (expert ids are global; a rank under
expert parallelism owns experts [first_expert, first_expert + num_experts)). Kernels work on rows in
expert-sorted order: sorted position p holds row ``order_N[p]``; ``inv_N[n]`` is the inverse; local
expert e owns sorted positions ``offsets_E1[e] : offsets_E1[e+1]``; the M-tile schedule lists, per
tile of `block_m` sorted rows, its (expert, first sorted row), -1 past the real count.

Every size follows from (N, E, block_m) on the host, so building a plan never synchronises and the
whole op can be captured in a CUDA graph. The plan lives in one int32 buffer (`packed`), which the op
saves for the backward as one tensor; `RoutingPlan.from_packed` rebuilds the views.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch


class RowSource(str, enum.Enum):
    GATHER = "gather"
    CONTIGUOUS = "contiguous"


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Host-known upper bound on sum_e ceil(count_e / block_m)."""
    if num_rows == 0:
        return 0
    return min(-(-num_rows // block_m) + num_experts - 1, num_rows)


@dataclass(frozen=True)
class PlanLayout:
    """Everything about a plan that the host knows without looking at the routing."""

    num_rows: int  # N
    num_experts: int  # local experts E
    block_m: int  # sorted rows per M-tile (every row-tiled kernel uses this one schedule)
    rows_per_token: int  # K for GATHER, 1 for CONTIGUOUS
    source: RowSource = RowSource.GATHER
    first_expert: int = 0  # global id of local expert 0

    @property
    def num_tiles(self) -> int:
        return max_tiles(self.num_rows, self.num_experts, self.block_m)

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        """Lengths of order, inv, offsets, tile_expert, tile_row, ids_ok in the packed buffer, in order
        (the routing kernel writes this layout)."""
        n, t = self.num_rows, self.num_tiles
        return (n, n, self.num_experts + 1, t, t, 1)

    @property
    def packed_size(self) -> int:
        return sum(self.segment_sizes)


@dataclass(frozen=True)
class RoutingPlan:
    layout: PlanLayout
    packed: torch.Tensor  # int32 [layout.packed_size]: the views below, in one buffer
    order_N: torch.Tensor  # int32 [N]: sorted position -> row
    inv_N: torch.Tensor  # int32 [N]: row -> sorted position
    offsets_E1: torch.Tensor  # int32 [E+1]: first sorted position of each local expert, offsets[E] == N
    tile_expert: torch.Tensor  # int32 [num_tiles]: local expert of each M-tile, -1 past the real count
    tile_row: torch.Tensor  # int32 [num_tiles]: first sorted row of each M-tile
    ids_ok: torch.Tensor  # int32 [1]: 1 when every expert id was a local expert

    @classmethod
    def from_packed(cls, packed: torch.Tensor, layout: PlanLayout) -> "RoutingPlan":
        return cls(layout, packed, *torch.split(packed, layout.segment_sizes))

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows

    @property
    def rows_per_token(self) -> int:
        return self.layout.rows_per_token

    @functools.cached_property
    def _expert_schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        from .kernels.routing_meta import expert_schedule

        return expert_schedule(self.offsets_E1, self.layout.block_m)

    @property
    def experts_by_load(self) -> torch.Tensor:
        """int32 [E]: local experts, most rows first (stable), on the device: the weight-gradient kernels
        start their programs on the heaviest experts. Made once per plan object, with `expert_first_tile`
        (both weight gradients of a backward share them; `kernels.routing_meta.expert_schedule`)."""
        return self._expert_schedule[0]

    @property
    def expert_first_tile(self) -> torch.Tensor:
        """int32 [E]: each local expert's first M-tile (the tiles of the experts before it; tiles are
        `layout.block_m` rows of one expert, experts in order), on the device: where the token-tile operands
        of the weight gradients start for that expert."""
        return self._expert_schedule[1]

    def sorted_source_rows(self, rows_RD: torch.Tensor) -> torch.Tensor:
        """The source rows of this plan's rows in expert-sorted order, [N, D]: sorted position p holds
        row order[p] // K of rows_RD (the oracle of `kernels.sorted_rows`, which reads each source row once)."""
        src = self.order_N if self.rows_per_token == 1 else torch.div(self.order_N, self.rows_per_token,
                                                                      rounding_mode="floor")
        return rows_RD.index_select(0, src)
