"""Per-rank memory before launch: pretrain.py (the whole model or a pipeline rank's stages; stages.py: what a
pipeline rank holds and the micro-batches its schedule keeps in flight), posttrain.py (the teacher
and the feedback losses on top), teacher.py (the prefix-shared teacher's passes), probe.py (activations measured
on the CPU at the real widths) and coarse.py (the activation formula the step models rank layouts by)."""
