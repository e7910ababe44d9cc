"""bench/host_time.py: the host's time per step of each stage's machinery, on a model too small to hide it."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "host_time.py"


def host_time(*flags):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, flags)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def block_parameters(width):
    """One block of the book's GPT at `width`, without qkv biases: attention 4 w^2 + w, MLP 8 w^2 + 5 w, two
    LayerNorms 4 w."""
    return 12 * width * width + 10 * width


def test_each_stage_is_timed_phase_by_phase_in_a_process_of_its_own():
    done = host_time("--runs", "01,02-split,03,03-resharded,03-one-unit,03-unsharded", "--no-compile", "--steps", 3,
                     "--warmup", 1, "--layers", 2, "--repeats", 1, "--profile", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    timed, profiled = done.stdout.split("Where the host's time goes")
    rows = {line.split(" | ")[0].strip("| "): line for line in timed.splitlines() if line.startswith("| 0")}
    assert list(rows) == ["01", "02-split", "03", "03-resharded", "03-one-unit", "03-unsharded"], done.stdout
    for line in rows.values():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert all(float(cell) > 0 for cell in [cells[1].split()[0], *cells[2:5]]), line
    assert "2 blocks 64 wide" in done.stdout and "eager (--no-compile)" in done.stdout
    # DDP's 25 MiB buckets shrunk by the ratio of a 64-wide block to GPT-2 small's 768-wide one: about a block each;
    # eager, there is no compiled graph for them to split (the graphs' count comes from Dynamo's log when compiled)
    expected = 25 * block_parameters(64) / block_parameters(768)
    assert f"buckets of {expected:.3f} MiB, eager: no graph to split" in rows["02-split"], rows["02-split"]
    assert re.search(r"\| 03 \|.*\|\s*\|$", rows["03"])  # no notes where nothing was shrunk
    assert rows["03-resharded"].endswith("| each block gathers its weights again for its backward |")
    assert rows["03-one-unit"].endswith("| FSDP2's unit on the whole model alone, not on each block |")
    assert rows["03-unsharded"].endswith("| no FSDP2: the blocks compiled one by one, the rest eager |")
    # --profile: the regions side by side, FSDP2's hooks only where FSDP2 shards, DDP's all-reduce only in 02
    assert "| region | 01 | 02-split | 03 | 03-resharded | 03-one-unit | 03-unsharded |" in profiled, profiled
    regions = {cells[0]: cells[1:] for cells in ([cell.strip() for cell in line.strip("|").split("|")]
                                                 for line in profiled.splitlines()[4:] if line.startswith("| "))}
    sharded = [value != "-" for value in regions["FSDP2: pre_forward"]]
    assert sharded == [False, False, True, True, True, False], regions
    assert [value != "-" for value in regions["collectives"]] == [False, True, False, False, False, False], regions
    assert "compiled graphs, forward" not in regions  # eager: no graph
    for column, step in enumerate(regions.pop("profiled step")):  # the regions and the rest make up the step
        parts = [float(values[column]) for values in regions.values() if values[column] != "-"]
        assert abs(sum(parts) - float(step)) < 0.01 * len(parts) and all(part > 0 for part in parts[:-1]), regions


def test_each_event_counts_once_in_the_outermost_region_that_names_it():
    from types import SimpleNamespace

    from bench import host_time

    def event(name, ms, parent=None):
        return SimpleNamespace(name=name, cpu_time_total=ms * 1000, cpu_parent=parent)

    hook = event("FSDP::pre_forward (trf_blocks.0)", 4)
    graph = event("Torch-Compiled Region: 0/0", 10)
    events = [hook, event("c10d::_allgather_base_", 3, hook), event("aten::copy_", 1, hook), graph,
              event("CompiledFunction", 9, graph), event("nccl:all_reduce", 2), event("Optimizer.step#AdamW.step", 1),
              event("aten::mul", 5)]
    regions = host_time.host_regions(events, steps=2, step_ms=20.0)
    assert regions == {"compiled graphs, forward": 5.0, "FSDP2: pre_forward": 2.0, "collectives": 1.0,
                       "optimizer step": 0.5, "the rest: Python, autograd's engine, eager ops": 11.5}


def test_the_regions_are_each_runs_mean_over_its_processes_and_still_add_up():
    from bench import host_time

    rest = host_time.REST
    results = [{"run": "02", "regions": {"collectives": 1.0, "optimizer step": 2.0, rest: 3.0}},
               {"run": "02", "regions": {"optimizer step": 4.0, rest: 5.0}},  # no collective event profiled here
               {"run": "01", "regions": {"optimizer step": 9.0, rest: 1.0}}]
    regions = host_time.mean_regions(results, "02")
    assert regions == {"collectives": 0.5, "optimizer step": 3.0, rest: 4.0}  # 01's process not among them
    assert sum(regions.values()) == (6.0 + 9.0) / 2  # the mean profiled step


def test_the_table_sets_each_runs_median_process_beside_01s():
    from bench import host_time

    def process(run, step, notes=""):
        return {"run": run, "notes": notes, "torch": "2.x",
                "ms": {"forward with loss": step / 2, "backward": step / 4, "optimizer step": step / 8, "step": step}}

    args = host_time.build_parser().parse_args(["--repeats", "3"])
    processes = [process("01", 30), process("02", 99), process("01", 10), process("02", 40), process("01", 20),
                 process("02", 50, "its notes")]
    text = host_time.table(processes, args)
    assert "| 01 | 20.00 (10.00-30.00) | 10.00 | 5.00 | 2.50 | 1.00 |  |" in text, text  # the middle one, whole
    assert "| 02 | 50.00 (40.00-99.00) | 25.00 | 12.50 | 6.25 | 2.50 | its notes |" in text, text
    assert "| 02 | 50.00 (40.00-99.00) | 25.00 | 12.50 | 6.25 | n/a | its notes |" in host_time.table(processes[1::2],
                                                                                                      args)


def test_an_unknown_run_or_a_missing_gpu_is_refused_in_one_line():
    runs = "01, 02, 02-split, 03, 03-resharded, 03-one-unit, 03-unsharded"
    for flags, message in ((("--runs", "01,04"), f"the runs are {runs}"),
                           (("--device", "cuda"), "sees no CUDA GPU"),
                           (("--repeats", 0), "--steps, --layers and --repeats take a whole number from 1"),
                           (("--profile", -1), "--warmup and --profile from 0")):
        done = host_time(*flags)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout


def test_03_resharded_makes_the_blocks_free_their_weights_after_the_forward():
    from bench import host_time

    calls = []
    shard = host_time.resharding_blocks(lambda module, **options: calls.append((module, options)))
    shard("block", mesh="m", reshard_after_forward=False)  # 03's blocks at one process
    shard("model", mesh="m")  # 03's root unit: FSDP2's default, left alone
    assert calls == [("block", {"mesh": "m", "reshard_after_forward": True}), ("model", {"mesh": "m"})]


def test_03_one_unit_shards_the_whole_model_alone_and_leaves_the_blocks_to_it():
    """host_time's 03-one-unit and the ladder's --option fsdp-one-unit: the module holding the blocks is the unit."""
    from types import SimpleNamespace

    from bench.rungs import whole_model_unit

    calls, model = [], SimpleNamespace(trf_blocks=[])
    shard = whole_model_unit(lambda module, **options: calls.append((module, options)) or module)
    assert shard("block", mesh="m", reshard_after_forward=False) == "block"  # a block: no unit of its own
    shard(model, mesh="m")
    assert calls == [(model, {"mesh": "m"})]
