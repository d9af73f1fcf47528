"""The planner: what a training job costs before it runs (time per step, bytes per link, memory per rank), with
public names for launch/ and benchmarks/ to use. It imports neither (tests/entry/test_import_layers.py).

  devices.py         the one device table (datasheet peaks, memory as torch reports it, link line rates)
  network.py         seconds of one collective: NCCL all-to-all by message size, DeepEP-class dispatch from its
                     published table, ring collectives, NVLink; compute slowed under communication
  flops.py           FLOPs per token by part and kernel class, what activation checkpointing reruns
  wire.py            bytes on the wire of one collective (in-node / across nodes)
  fsdp_traffic.py    FSDP's bytes per unit and mesh group; ep_traffic.py: the EP dispatch plan's bytes
  recording.py       a real step's collectives and live storages, counted the same way (the dry run, tests)
  step.py            one training step of a PP / TP / EP / FSDP / ZeRO-1 layout (published runs, PP candidates)
  dual_mesh.py       one training step of the runtime's dual-mesh layouts, per EP dispatch combination
  pipeline.py        PP candidates on step.py's model; optimizer_step.py: the sharded Muon step
  parameters.py      the fitted parameters (calibration/fitted.json); bands.py: low / central / high of a
                     projection from the cross-validated error
  memory/            per-rank memory: pretrain.py (and per pipeline stage: stages.py), posttrain.py, teacher.py, probe.py
                     (measured activations), coarse.py (the one activation formula the step models rank by)
  calibration/       published runs as case files (cases/*.toml), the joint fit and its cross-validation
                     (fit.py; benchmarks/calibrate.py --cross-validate)
"""
