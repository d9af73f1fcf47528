"""Which layouts cannot be compiled yet (no torch: the config refuses `training.compile=true` with them
before torch loads; parallel/compile.py compiles the rest)."""


def check_compile(layout) -> None:
    """ValueError (one line) if `compile_refusal` finds a reason."""
    reason = compile_refusal(layout)
    if reason is not None:
        raise ValueError(reason)


def compile_refusal(layout) -> str | None:
    """Why `layout` cannot be compiled yet (every offending key in one line), or None: only the direct EP
    path (none of the EP variant knobs) composes with compile."""
    variants = {"ep_dedup": layout.ep_dedup, "ep_capacity_factor": layout.ep_capacity_factor > 0,
                "ep_overlap_chunks": layout.ep_overlap_chunks > 1,
                "ep_dispatch_dtype": layout.ep_dispatch_dtype != "compute",
                "ep_recompute": layout.ep_recompute != "resend",
                "ep_combine_grad_dtype": layout.ep_combine_grad_dtype != "compute"}
    on = [f"parallel.{key}={getattr(layout, key)!r}" for key, enabled in variants.items() if enabled]
    if not on:
        return None
    return (f"training.compile=true with {', '.join(on)}: only the direct EP path compiles yet; "
            f"set training.compile=false or leave these knobs at their defaults")
