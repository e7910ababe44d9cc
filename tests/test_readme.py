"""The README teaches first: short, the results and the picture on top, one section per step with the stages' real
code, and every link of the README and the docs resolves."""

import re

from conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
STAGES = ("00_orig.py", "01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py", "03_opt_multi_gpu_fsdp.py")
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "cost_model" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def headings():
    return [match.group(1) for match in re.finditer(r"^## (.+)$", README, flags=re.MULTILINE)]


def step_sections():
    """{step number: its section's text}, from the '### Step N: ...' headings."""
    parts = re.split(r"^(?=#{2,3} )", README, flags=re.MULTILINE)
    return {int(match.group(1)): part for part in parts if (match := re.match(r"### Step (\d+): ", part))}


def python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def missing_lines(block):
    """The lines of a README snippet that are not lines of the stage file it quotes. A `# 01_opt_single_gpu.py`
    line names the file the lines after it come from (any stage before the first one); `...` elides."""
    sources = {name: set((ROOT / name).read_text(encoding="utf-8").splitlines()) for name in STAGES}
    quoted, missing = set().union(*sources.values()), []
    for line in block.splitlines():
        if line.strip() in {"", "..."}:
            continue
        if line.startswith("# ") and line[2:].strip() in STAGES:
            quoted = sources[line[2:].strip()]
            continue
        if line.rstrip() not in quoted:
            missing.append(line)
    return missing


def test_the_readme_is_a_lesson_of_at_most_350_lines_in_a_learners_order():
    assert len(README.splitlines()) <= 350, len(README.splitlines())
    titles = headings()
    order = ["Results at a glance", "Quick start", "The stages", "The ten steps", "Measuring right on a GPU",
             "Why it pays", "Stage 02", "Stage 03", "Gradient accumulation", "What to expect on your GPU",
             "Try it yourself", "Where to go next"]
    positions = [next(i for i, title in enumerate(titles) if title.startswith(name)) for name in order]
    assert positions == sorted(positions), titles


def test_the_results_and_the_picture_come_before_the_quick_start():
    top = README.split("## Quick start", 1)[0]
    assert "<!-- at a glance" in top and "| 01 |" in top  # rendered from the results folders
    picture = re.search(r"!\[[^\]]*\]\(([^)]+\.png)\)", top)
    assert picture and (ROOT / picture.group(1)).exists(), "the loss-against-time picture, above the quick start"


def test_every_step_has_a_section_with_its_code_its_reason_its_numbers_and_a_pitfall():
    sections = step_sections()
    assert sorted(sections) == list(range(1, 11))
    for step, text in sections.items():
        blocks = python_blocks(text)
        assert blocks, f"step {step} shows no code"
        for block in blocks:
            assert not missing_lines(block), f"step {step}: not in the stage files: {missing_lines(block)}"
        for part in ("**Why:**", "**Measured:**", "**Pitfall:**", "H200"):
            assert part.lower() in text.lower(), f"step {step} has no {part}"
        assert "A100" in text, f"step {step}: the original tutorial's A100 gain beside ours"


def test_a_snippet_that_drifts_from_its_stage_fails():
    """The check above on a snippet that once was true: a line edited since is caught, an exact one is not."""
    exact = "# 01_opt_single_gpu.py\n        self.norm1 = nn.LayerNorm(cfg[\"emb_dim\"])  # NEW (step 6)\n"
    assert missing_lines(exact) == []
    assert missing_lines(exact.replace("norm1", "norm_1")) == ['        self.norm1 = nn.LayerNorm(cfg["emb_dim"])  # '
                                                               'NEW (step 6)'.replace("norm1", "norm_1")]
    assert missing_lines("# 00_orig.py\n" + exact.split("\n", 1)[1])  # 00 has no nn.LayerNorm


def test_what_left_the_readme_is_still_documented():
    everything = "\n".join(page.read_text(encoding="utf-8") for page in DOCS)
    for needed in ("## Exit codes", "python -m data.prepare", "<!-- published measurements", "| GPU | bf16 | fp16 |",
                   "python -m pytest -q tests", "## Looking inside a run", "## Checkpoints and resuming"):
        assert needed in everything, needed
    assert "python -m pytest -q tests\n" in README  # the command CI runs, where a reader finds it


def test_every_local_link_of_the_readme_and_docs_resolves():
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def github_anchor(title):
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_anchor_a_page_links_to_is_a_heading_there():
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            linked = (page.parent / target) if target else page
            if target.startswith(("http://", "https://")) or linked.suffix != ".md":
                continue
            titles = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.MULTILINE)
            assert anchor in {github_anchor(title) for title in titles}, f"{page.name} links to {target}#{anchor}"


def test_bench_readme_lists_every_ladder_option_in_one_table():
    """bench/README.md's --option table has a row per option the ladder takes, and the table is one table."""
    from bench.rungs import OPTIONS

    text = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    section = text.split("## Trying a change before it goes into 01: `--option`")[1].split("\n## ")[0]
    table = re.search(r"^\| option \|.*?(?=\n(?!\|))", section, flags=re.MULTILINE | re.DOTALL).group(0)
    assert re.findall(r"^\| `([a-z-]+)` \|", table, flags=re.MULTILINE) == list(OPTIONS)
