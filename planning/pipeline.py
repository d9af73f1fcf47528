"""Pipeline-parallel layouts (PP + EP inside a node or two + ZeRO-1), which the runtime does not implement yet,
on the calibrated step model (planning/step.py), beside the runtime's dual-mesh rows (planning/dual_mesh.py);
benchmarks/pp_projection.py is the command line.

The model, sequence length, tokens per GPU per step (weak scaling from the config's world size) and activation
checkpointing come from the config; each candidate is pp in PP_DEGREES x ep in EP_DEGREES (8: the all-to-alls
stay on NVLink; 16: two nodes) x the three schedules, micro-batches of one sequence, torch's all_to_all_single
("nccl": what the runtime would use), ZeRO-1. A row fits when its coarse memory (planning/step.memory_gib) is
under FIT_FRACTION of the device's.
"""

import dataclasses

from planning import bands, step

PP_DEGREES = (4, 8, 16)
EP_DEGREES = (8, 16)
SKEW_LOW = 1.2  # planning/dual_mesh.py's what-if beside the band
FIT_FRACTION = 0.9


def candidates(job, world: int, config_world: int, device) -> list[step.Run]:
    """The PP layouts at `world` GPUs with the config's tokens per GPU (module docstring)."""
    sequences = job.data.batch_size * world // config_world
    out = []
    for pp in PP_DEGREES:
        for ep in EP_DEGREES:
            for schedule, virtual in (("1f1b", 1), ("interleaved", 2), ("dualpipe", 1)):
                run = step.Run(
                    model=job.model, device=device, gpus=world, gpus_per_node=device.gpus_per_node,
                    seq_len=job.data.seq_len, global_batch=sequences, micro_batch=1, gemm_precision="bf16",
                    dispatcher="nccl", activation_checkpoint=job.training.activation_checkpoint, pp=pp,
                    virtual_stages=virtual, pp_schedule=schedule, ep=ep, dp_sharding="zero1")
                try:
                    step.check_run(run)
                except ValueError:
                    continue
                out.append(run)
    return out


def row(run: step.Run, memory_gib: float) -> dict:
    """One candidate's terms, band and fit."""
    terms = step.step_terms(run)
    skewed = step.step_terms(dataclasses.replace(run, skew=SKEW_LOW))
    central = terms["tokens_per_gpu_s"]
    band = bands.band(central)
    per_token = terms["mfu_bf16"] / central
    return {"world": run.gpus, "layout": f"pp{run.pp} {run.pp_schedule}{'x2' if run.virtual_stages > 1 else ''} "
                                         f"ep{run.ep} dp{run.dp} zero1",
            "time_s": terms, "tokens_per_gpu_s_band": band, "mfu_band": tuple(b * per_token for b in band),
            "tokens_per_gpu_s_skew_1_2": skewed["tokens_per_gpu_s"], "band_rests_on": bands.RESTS_ON,
            "fits": terms["memory_gib"] <= FIT_FRACTION * memory_gib}
