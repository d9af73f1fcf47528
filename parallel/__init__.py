"""Dual-mesh parallelism: layouts (layout.py), meshes (meshes.py), and the functions that shard an
unchanged model (parallelize.py: context_parallel, expert_parallel, fsdp), plus the loss and
gradient-norm conventions that keep every layout equal to the single-process step (gradients.py).
"""
