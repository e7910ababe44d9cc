"""The stages as a reader diffs them: two consecutive stage files differ by few lines, and every hunk of their
difference says which step of the lesson it belongs to (a `# NEW (...)` tag among its added lines)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TAG = "NEW ("
# changed lines (insertions + deletions, as `git diff --no-index --numstat` counts them) allowed per pair
BUDGETS = {
    ("00_orig.py", "01_opt_single_gpu.py"): 130,
    ("01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py"): 110,
    ("02_opt_multi_gpu_ddp.py", "03_opt_multi_gpu_fsdp.py"): 100,
}
PAIRS = list(BUDGETS)


def git_diff(before, after, *options):
    """`git diff --no-index` of two files with git's default algorithm and 3 lines of context, whatever the
    user's configuration says; it exits 1 when the files differ."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    result = subprocess.run(["git", "diff", "--no-index", "--no-color", "--no-ext-diff", "--diff-algorithm=myers",
                             "--unified=3", *options, str(before), str(after)], capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stderr
    return result.stdout


def changed_lines(before, after):
    counts = git_diff(before, after, "--numstat").split()
    return int(counts[0]) + int(counts[1]) if counts else 0


def hunks(before, after):
    """Each hunk of the difference as its lines, the "@@ ... @@" header first."""
    found = []
    for line in git_diff(before, after).splitlines():
        if line.startswith("@@"):
            found.append([line])
        elif found:
            found[-1].append(line)
    return found


def untagged_hunks(before, after):
    return [hunk for hunk in hunks(before, after)
            if not any(line.startswith("+") and TAG in line for line in hunk[1:])]


@pytest.mark.parametrize("before, after", PAIRS, ids=[f"{a[:2]}-{b[:2]}" for a, b in PAIRS])
def test_the_stage_diff_stays_within_its_budget(before, after):
    changed = changed_lines(ROOT / before, ROOT / after)
    assert changed <= BUDGETS[before, after], (
        f"git diff --no-index {before} {after}: {changed} changed lines, more than the {BUDGETS[before, after]} "
        "a reader is asked to read: move plumbing into a shared module, or make 00's lines match the next stage's")


@pytest.mark.parametrize("before, after", PAIRS, ids=[f"{a[:2]}-{b[:2]}" for a, b in PAIRS])
def test_every_hunk_of_the_stage_diff_is_tagged(before, after):
    untagged = untagged_hunks(ROOT / before, ROOT / after)
    assert not untagged, (f"git diff --no-index {before} {after}: hunks without a '# NEW (...)' tag among their "
                          "added lines:\n\n" + "\n\n".join("\n".join(hunk) for hunk in untagged))


def test_an_untagged_change_is_caught(tmp_path):
    """The check itself: a changed line without a tag in a copy of stage 01 makes a hunk of its own, found."""
    line = '    ax2.set_xlabel("Tokens seen")\n'
    source = (ROOT / "01_opt_single_gpu.py").read_text(encoding="utf-8")
    assert source.count(line) == 1
    untagged, tagged = tmp_path / "untagged.py", tmp_path / "tagged.py"
    untagged.write_text(source.replace(line, line.replace("seen", "trained on")), encoding="utf-8")
    tagged.write_text(source.replace(line, line.replace("seen", "trained on")[:-1] + "  # NEW (step 9)\n"),
                      encoding="utf-8")
    found = untagged_hunks(ROOT / "00_orig.py", untagged)
    assert len(found) == 1 and '+    ax2.set_xlabel("Tokens trained on")' in found[0], found
    assert not untagged_hunks(ROOT / "00_orig.py", tagged)
    before = changed_lines(ROOT / "00_orig.py", ROOT / "01_opt_single_gpu.py")
    assert changed_lines(ROOT / "00_orig.py", untagged) == before + 2


def test_step_10_is_the_batch_alone():
    """Gradient accumulation is tagged as its own lesson (NEW (accumulation)), not as step 10's larger batch."""
    for name in ("01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py", "03_opt_multi_gpu_fsdp.py"):
        step_10 = [line for line in (ROOT / name).read_text(encoding="utf-8").splitlines() if "NEW (step 10)" in line]
        assert step_10 and not [line for line in step_10 if "accum" in line], (name, step_10)
