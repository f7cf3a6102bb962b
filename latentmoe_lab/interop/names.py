"""One record per tensor: our state-dict name, the transformers checkpoint's name(s), and how one becomes the other.

Each architecture module (kimi_linear.py, deepseek_v32.py) lists its tensors as TensorMappings in one table;
this module holds the only code that moves values between the two layouts (docs/design.md §17):

    copy         one tensor, same shape
    reshape      one tensor, same elements, another shape        (kimi A_log: ours [H], theirs [1, 1, H, 1])
    concat       theirs joined along dim 0, in order             (kimi short conv: q | k | v)
    experts      theirs[e] is expert e's Linear weight [out, in]; ours stacked [E, in, out]   (down projections)
    experts_glu  theirs = E gate weights, then E up weights, each [inter, in]; ours [E, in, 2 * inter] (gate | up)

Both directions are exact rearrangements (no arithmetic), so ours -> theirs -> ours is bit-exact.
The rearrangement is one function, their_views: views of our tensor in their shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("copy", "reshape", "concat", "experts", "experts_glu")


class Unexpressible(ValueError):
    """A model feature the target checkpoint format cannot express; the message names the feature."""


@dataclass(frozen=True)
class TensorMapping:
    """ours: our state-dict name; theirs: the checkpoint's name(s); kind: one of KINDS (module docstring).

    parts (concat only): the dim-0 size of each of theirs, in order. their_shape (reshape only): their layout.
    """

    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"
    parts: tuple[int, ...] = ()
    their_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if isinstance(self.theirs, str):
            raise TypeError("theirs: expected a tuple of names, got one str")
        single = self.kind in ("copy", "reshape")
        if single and len(self.theirs) != 1:
            raise ValueError(f"theirs: a {self.kind} mapping takes one name, got {len(self.theirs)}")
        if self.kind == "concat" and len(self.parts) != len(self.theirs):
            raise ValueError(f"parts: a concat mapping needs one size per name ({len(self.theirs)}), got {self.parts}")
        if self.kind == "reshape" and not self.their_shape:
            raise ValueError("their_shape: a reshape mapping needs the checkpoint's shape")
        if self.kind == "experts_glu" and len(self.theirs) % 2:
            raise ValueError(f"theirs: an experts_glu mapping takes E gate then E up names, got {len(self.theirs)}")


def mapping(ours: str, theirs: str | list[str] | tuple[str, ...], kind: str = "copy",
            parts: tuple[int, ...] = (), their_shape: tuple[int, ...] = ()) -> TensorMapping:
    """TensorMapping with one name or a list of names for `theirs`."""
    names = (theirs,) if isinstance(theirs, str) else tuple(theirs)
    return TensorMapping(ours, names, kind, tuple(parts), tuple(their_shape))


def their_views(entry: TensorMapping, ours: torch.Tensor) -> list[torch.Tensor]:
    """Views of our tensor, one per name in entry.theirs, each in their shape: loading copies each stored tensor
    into its view (no intermediate), exporting writes each view out. Both are pure copies, hence bit-exact."""
    if entry.kind == "copy":
        return [ours]
    if entry.kind == "reshape":
        if _numel(entry.their_shape) != ours.numel():
            raise ValueError(f"{entry.ours}: their shape {list(entry.their_shape)} does not hold the "
                             f"{ours.numel()} elements of ours {list(ours.shape)}")
        return [ours.view(entry.their_shape)]
    if entry.kind == "concat":
        if sum(entry.parts) != ours.shape[0]:
            raise ValueError(f"{entry.ours}: parts {list(entry.parts)} do not add up to dim 0 of {list(ours.shape)}")
        return list(ours.split(list(entry.parts), dim=0))
    experts = ours.shape[0]
    if entry.kind == "experts":
        if len(entry.theirs) != experts:
            raise ValueError(f"{entry.ours}: {len(entry.theirs)} expert names for {experts} experts")
        return [ours[e].t() for e in range(experts)]
    if len(entry.theirs) != 2 * experts:
        raise ValueError(f"{entry.ours}: {len(entry.theirs)} gate / up names for {experts} experts")
    gates, ups = ours.chunk(2, dim=-1)  # [E, in, inter] each
    return [gates[e].t() for e in range(experts)] + [ups[e].t() for e in range(experts)]


def their_shapes(entry: TensorMapping, our_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shape each of entry.theirs must have for our tensor of our_shape (nothing allocated)."""
    return [tuple(view.shape) for view in their_views(entry, torch.empty(our_shape, device="meta"))]


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
