"""How parameters are laid out in flat units and split into per-rank slices."""
from zeroshard.layout.unit_layout import Piece, Segment, UnitLayout, as_real, real_dtype
from zeroshard.layout.bucketing import NamedParam, build_layouts, layouts_for

__all__ = ["Piece", "Segment", "UnitLayout", "as_real", "real_dtype", "NamedParam", "build_layouts", "layouts_for"]
