"""Shard boxes for the optimizer: re-exported from parallel/boxes.py, their one definition."""

from parallel.boxes import all_boxes, chunk, cut_order, dtensor_box, local_box, placement_kind, strided_shard

__all__ = ["all_boxes", "chunk", "cut_order", "dtensor_box", "local_box", "placement_kind", "strided_shard"]
