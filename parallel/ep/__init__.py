"""Expert parallelism: one dispatcher object per MoE layer (dispatcher.py), built once from the frozen
EP config (config.py, with the one table of refused knob combinations). The mechanisms it holds live in
parallel/expert_parallel.py (direct dispatch), parallel/ep_*.py and parallel/recompute_ahead.py."""
