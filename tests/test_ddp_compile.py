"""Stage 02 compiles forward and loss as one graph that DDP wraps: no graph break at world size 1 either, with
gradient accumulation too.

The two-process case shares its run with test_speed_habits.py (dropout states per rank), which also asserts
that TORCH_LOGS=graph_breaks stays silent there. Both first show that their probe works: a deliberate graph break
and recompile print the words they look for, and the run's own TORCH_LOGS output is there.
"""

import re

from test_speed_habits import check_the_probe_of_breaks_and_recompiles, compiled_frames
from test_stage02_ddp import clean_env, run_all, torchrun


def test_stage02_compiles_without_graph_breaks_in_one_process(small_text, tmp_path, capfd):
    # Before DDP wrapped the compiled unit, Dynamo traced into DDP's own forward and broke the graph at its
    # _pre_forward and in contextlib frames: 4 "Graph break" lines in this very run.
    check_the_probe_of_breaks_and_recompiles(capfd)  # the words searched for below are the ones the logs use
    [(rc, stdout, stderr)] = run_all([torchrun(
        "--standalone", "--nproc_per_node=1", "02_opt_multi_gpu_ddp.py", "--tiny", "--data", small_text,
        "--out", tmp_path / "run", "--max-steps", 4, "--eval-freq", 2, "--eval-iter", 1,
        "--batch-size", 2, "--grad-accum-steps", 2)], timeout=300,  # require_backward_grad_sync off, then on
        envs=[clean_env(TORCH_LOGS="graph_breaks,recompiles,dynamo")])
    assert rc == 0, stdout[-2000:] + stderr[-3000:]
    traced = [name for _, _, name in compiled_frames(stderr)]  # TORCH_LOGS reached the run: dynamo's lines are there
    assert "training_loss" in traced and "evaluation_loss" in traced, stderr[-3000:]
    assert "Graph break" not in stderr, re.findall(r".*Graph break.*", stderr)[:3]
    assert "Recompiling" not in stderr, re.findall(r".*Recompiling.*", stderr)[:3]
