"""Pipeline parallelism: the model cut into stages by layers, run by torch.distributed.pipelining's schedules.

    config.py    PipelineConfig: the `[parallel]` pipeline knobs (ParallelConfig inherits them)
    plan.py      the pure plan: stage ranks, layers per stage, stages per rank, the schedules' refusals
    part.py      ModelPart: a stage (or all of a rank's stages) under the whole model's parameter names
    schedule.py  Pipeline: PipelineStages with declared shapes and the schedule that runs the micro-batches
"""
