"""The ladder's planning: what a command measures, and whether the next run fits in --time-limit.

A command's plan is a list of jobs, each one row of the results folder: the rungs asked for (with --rungs missing,
those without a row), then the --check-scripts runs. Before each job, the runs of the same kind this command has
made say how long it will take; a job that would end after --time-limit is not started, and the command prints the
command that measures the rest. Nothing here runs a rung (bench/runner.py does) or renders a table
(bench/report.py).
"""

import math
import shlex
import time
from collections import namedtuple
from pathlib import Path

from bench import report

# One row to measure: its file's name, what the progress lines call it, its kind (for --time-limit), the rung it
# belongs to, the --check-scripts script it runs (None for a rung) and its log.
Job = namedtuple("Job", "name label kind rung script log")


def script_checks():
    """--check-scripts: (script, the rung it is set beside): 00 and 01 as they are, beside rungs 0 and 10."""
    from bench.rungs import STAGE_00, STAGE_01

    return ((STAGE_00, 0), (STAGE_01, 10))


def rung_kind(number):
    """Rungs of one kind take about as long as each other: eager (0-7), compiled (8-10: compilation first), stage
    scripts under torchrun (11-12: start-up, evaluation, a sample and a checkpoint besides)."""
    return "eager" if number <= 7 else "compiled" if number <= 10 else "scripts"


def jobs(args, found, missing):
    """The jobs of this command, given the rows the folder holds (`found`, by name): the rungs of --rungs (with
    --rungs missing, those without a row; a failed rung keeps its row: name it to measure it again), then the
    --check-scripts runs (all of them again beside rungs named; with --rungs missing or none, those without a row)."""
    from bench.rungs import CHANGES, option_rungs

    numbers = args.rungs
    if missing:  # as --rungs all would: the rungs that take every option of the command
        numbers = [number for number in option_rungs(args.option) if report.rung_row_name(number) not in found
                   and not (args.context_length and number >= 11)]  # the scripts run at their own context
    planned = [Job(report.rung_row_name(number), f"rung {number}: {CHANGES[number]}", rung_kind(number), number, None,
                   f"logs/rung-{number:02d}.log") for number in numbers]
    for script, rung in script_checks() if args.check_scripts else ():
        if (missing or not args.rungs) and report.check_row_name(script) in found:
            continue
        planned.append(Job(report.check_row_name(script), f"the --check-scripts run of {script}", rung_kind(rung),
                           rung, script, f"logs/script-{Path(script).stem}.log"))
    return planned


def expected_seconds(kind, seconds_by_kind):
    """How long a run of `kind` should take, judged by the runs this command has made: the longest of the same kind,
    or twice the longest of any kind where none of that kind has run yet (compilation and torchrun's start-up make
    the later kinds the slower ones). None before the command's first run."""
    if not seconds_by_kind:
        return None
    longest = max(max(seconds) for seconds in seconds_by_kind.values())
    return max(seconds_by_kind[kind]) if kind in seconds_by_kind else 2 * longest


def seconds_left(jobs_left, seconds_by_kind):
    """How long the jobs not yet run should take, each judged as expected_seconds judges it: a compiled rung as long
    as the compiled rungs before it, not as the eager ones (None before the command's first run)."""
    if not seconds_by_kind:
        return None
    return sum(expected_seconds(job.kind, seconds_by_kind) for job in jobs_left)


def past_the_limit(time_limit, elapsed, expected):
    """Whether a run expected to take `expected` seconds, started `elapsed` seconds into the command, would end after
    --time-limit (never for the command's first run, when nothing says how long a run takes)."""
    return bool(time_limit and expected is not None and elapsed + expected > time_limit)


def run_timeout(rung_timeout, deadline):
    """(seconds, the flag that sets them) for the next run: --rung-timeout, or what is left before --time-limit's
    deadline where that is less. A run that outlasts the judgement is then stopped by the ladder itself, which ends
    the command in order, its rows and the command for the rest printed, rather than by whatever enforces the limit."""
    if deadline is None:
        return rung_timeout, "--rung-timeout"
    left = max(1, math.floor(deadline - time.monotonic()))
    return (left, "--time-limit") if left < rung_timeout else (rung_timeout, "--rung-timeout")


def describe_left(left):
    """The jobs not measured, in words: 'rungs 6–10 and the --check-scripts runs' (or the one check left)."""
    numbers = [job.rung for job in left if job.script is None]
    named = [f"rung{'s' if len(numbers) > 1 else ''} {report.rung_ranges(numbers)}"] if numbers else []
    checks = [job.label for job in left if job.script]
    return " and ".join(named + (checks if len(checks) == 1 else ["the --check-scripts runs"] if checks else []))


def continuation_command(argv, left, missing):
    """The command that measures what --time-limit left: this command's flags (argv, without the script's name),
    with --rungs set to the rungs left and --check-scripts kept only where those runs are left too; with
    --rungs missing, this command again."""
    if missing:
        return shlex.join(["python", "bench/ladder.py", *argv])
    checks_left = any(job.script for job in left)
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--rungs":
            skip_value = True
        elif not (arg.startswith("--rungs=") or arg == "--check-scripts" and not checks_left):
            kept.append(arg)
    numbers = report.rung_ranges((job.rung for job in left if job.script is None), dash="-", separator=",")
    return shlex.join(["python", "bench/ladder.py", "--rungs", numbers or "none", *kept])


def format_duration(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
