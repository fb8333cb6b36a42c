"""Boxes: axis-aligned regions of a global tensor. They live in
:mod:`shardpoint.format.boxes` (the format's layouts are made of them, and the
format may not import the planner); the planner uses them from here."""

from ..format.boxes import Box, box_runs, flat_range_boxes, grid_cells, intersect

__all__ = ["Box", "box_runs", "flat_range_boxes", "grid_cells", "intersect"]
