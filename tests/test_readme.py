"""The README teaches first: the lesson's sections come before the operations manual, and its links resolve."""

import re

from conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def headings():
    return [match.group(1) for match in re.finditer(r"^## (.+)$", README, flags=re.MULTILINE)]


def test_the_lesson_comes_before_the_operations_manual():
    titles = headings()
    lesson = ["The stages", "The ten optimizations of stage 01", "Why each step pays", "The ladder",
              "Looking inside a run"]
    positions = [next(i for i, title in enumerate(titles) if title.startswith(name)) for name in lesson]
    assert positions == sorted(positions), titles
    operations = next(i for i, title in enumerate(titles) if title.startswith("Running it"))
    assert max(positions) < operations, titles
    for moved in ("Checkpoints", "When things go wrong", "Exit codes"):  # now in docs/operations.md
        assert not any(title.startswith(moved) for title in titles), titles


def test_every_local_link_of_the_readme_and_docs_resolves():
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def github_anchor(title):
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_anchor_a_page_links_to_is_a_heading_there():
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")]
    for page in pages:
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
