"""`--model.init_from` under pipeline parallelism (issue 53, item 6): each rank opens only the safetensors files
that hold its stage's tensors, its loaded weights are the one-process load's exactly (a copy), and the first step
from them equals one process.

The checkpoint: the pipeline tests' model (tests/helpers/pp_cases.py: the debug preset at 6 blocks), every tensor
random (norms around 1, router biases too: a zero or a one would hide a tensor read from the wrong place), written
by the project's exporter in shards of 64 KiB, so the stages' tensors sit in different files (a file at the border
may hold both stages'). Which files a stage's tensors sit in comes from the index's weight_map here, by key name,
independently of the loader. Which files a rank opened comes from two records the loader does not keep:
  headers  Python's audit events (PEP 578, `sys.addaudithook`): every `open` of a .safetensors file;
  tensors  /proc/self/maps while the loader's files are held: safetensors maps each file it reads from.

Layouts: pp 2 on 2 ranks (a stage is one rank: it opens exactly its stage's files) and pp 2 x (dp_shard 2 x cp 2
= ep 4) on 8 ranks in two simulated nodes (a rank of a stage opens only files of its stage, and only those that
hold its experts; the stage's ranks together open all of its files). Tolerances: pp_cases' (loss and norm 1e-5,
gradients 2e-5, parameters 1e-5); the loaded weights bitwise.
"""

import json
import os
import sys

import pytest
import torch

from models.hf.checkpoint import load_pretrained, load_state, plan_files, save_pretrained
from models.hf.config import read_hf_config
from models.hf.files import INDEX
from multirank import run_ranks
from parallel.meshes import build_meshes
from parallel.pp.plan import stage_layers
from pp_cases import GRAD_RTOL, NORM_RTOL, PARAM_RTOL, PP2, SINGLE, full, job, run_job
from runtime import train as T
from runtime.config_parser import load_config
from seeded_models import seeded_model

N_LAYERS, SHARD_BYTES = 6, 64 * 2**10
TWO = {**SINGLE, "pp": 2}  # pp 2, one rank per stage


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf_pp") / "model")
    model = seeded_model("debug", 0, n_layers=N_LAYERS)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("expert_bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            elif t.is_floating_point() and not name.endswith("tokens_per_expert"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
    save_pretrained(model, path, shard_bytes=SHARD_BYTES)
    return path


def _weight_map(path: str) -> dict[str, str]:
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)["weight_map"]


def _stage_files(path: str, stages: int) -> list[set[str]]:
    """The files holding each stage's keys, by name: the embedding on the first stage, `model.layers.<i>.` of its
    blocks (parallel/pp/plan.py's even spread), the final norm and the head on the last."""
    layers = stage_layers(N_LAYERS, stages)
    out = []
    for s in range(stages):
        prefixes = [f"model.layers.{i}." for i in layers[s]]
        prefixes += ["model.embed_tokens."] if s == 0 else []
        prefixes += ["model.norm.", "lm_head."] if s == stages - 1 else []
        out.append({f for k, f in _weight_map(path).items() if k.startswith(tuple(prefixes))})
    return out


def _argv(parallel: dict, path: str, run_dir: str) -> list[str]:
    return job(parallel, 4, f"--model.init_from={path}", f"--run.dir={run_dir}")


def _opened_headers():
    """A list that collects the name of every .safetensors file this process opens from now on (audit events)."""
    names = []

    def hook(event, args):
        if event == "open" and isinstance(args[0], str) and args[0].endswith(".safetensors"):
            names.append(os.path.basename(args[0]))

    sys.addaudithook(hook)  # for the rest of this rank's process, which ends after the test's function
    return names


def _mapped() -> set[str]:
    with open("/proc/self/maps") as f:
        return {os.path.basename(line.split()[-1]) for line in f if line.rstrip().endswith(".safetensors")}


def _rank(rank, world_size, parallel, path, run_dir, reference):
    """(stage, headers opened by the runtime's load, files mapped by a second load, the stage's loaded weights
    whole (on the stage's first rank), errors of the first step against `reference`)."""
    config = load_config(_argv(parallel, path, run_dir))
    layout = config.layout(world_size)
    meshes = build_meshes(layout, "cpu")
    headers = _opened_headers()
    model, _ = T.build_pipeline(config, meshes, layout, torch.device("cpu"))
    opened = set(headers)
    weights = {n: full(t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if not n.endswith("tokens_per_expert")}  # full_tensor: collective over the stage's ranks
    stage_size = world_size // layout.pp
    fmt = read_hf_config(path)[1]
    files = plan_files(model, path, fmt)
    load_state(model, path, fmt, files)
    mapped = _mapped()  # while `files` holds the files open
    first = rank % stage_size == 0
    errors = run_job(_argv(parallel, path, run_dir), reference)["errors"]
    return rank // stage_size, opened, mapped, set(files.names), weights if first else None, errors


def _one(rank, world_size, path, run_dir):
    return run_job(_argv(SINGLE, path, run_dir))


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory):
    return run_ranks(_one, 1, hf_dir, str(tmp_path_factory.mktemp("run1")))[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads which files a rank maps from Linux's /proc")
@pytest.mark.parametrize("layout,world", [("pp2", 2), ("pp2_dp2_cp2_ep4", 8)])
def test_each_rank_opens_only_its_stage_files_and_loads_the_one_process_weights(hf_dir, reference, tmp_path,
                                                                                 layout, world):
    parallel = TWO if world == 2 else PP2
    stage_files, every = _stage_files(hf_dir, 2), set(_weight_map(hf_dir).values())
    assert all(files and files != every for files in stage_files), stage_files  # the stages' files differ
    ranks = run_ranks(_rank, world, parallel, hf_dir, str(tmp_path / "run"), reference, timeout=300)
    whole = load_pretrained(hf_dir).state_dict()
    for stage in range(2):
        mine = [r for r in ranks if r[0] == stage]
        for _, opened, mapped, planned, _, _ in mine:
            assert opened <= stage_files[stage] and mapped <= opened and planned == opened, (stage, opened, mapped)
        assert set().union(*(r[1] for r in mine)) == stage_files[stage]
        if world == 2:
            assert mine[0][1] == mine[0][2] == stage_files[stage]  # one rank per stage: all its files, all read
        weights = next(r[4] for r in mine if r[4] is not None)
        assert weights and all(torch.equal(t, whole[n]) for n, t in weights.items()), stage
    print(f"{layout}: {len(every)} files; per rank opened {[len(r[1]) for r in ranks]}, "
          f"stage files {[len(f) for f in stage_files]}")
    for rank, (*_, errors) in enumerate(ranks):
        assert errors["loss"] <= NORM_RTOL and errors["norm"] <= NORM_RTOL, (rank, errors)
        assert errors["grad"] <= GRAD_RTOL and errors["param"] <= PARAM_RTOL and errors["eval"] <= NORM_RTOL, errors
        assert errors["bias"] and errors["clipped"] and not errors["no_grad"], (rank, errors)
