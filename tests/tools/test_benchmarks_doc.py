"""docs/benchmarks.md is generated from benchmarks/results/ (benchmarks/make_docs.py) and matches what is committed;
every kept results JSON names its commit; the README and docs link only to results files that exist and keep their
tables well formed; a benchmark never overwrites a results file."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
PAGES = [REPO / "README.md", BENCH / "NOTES.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import common
    import make_docs

    return common, make_docs


def test_benchmarks_page_is_what_the_results_give(bench):
    _, make_docs = bench
    assert (REPO / "docs" / "benchmarks.md").read_text() == make_docs.render(), \
        "docs/benchmarks.md differs from the results: run `python benchmarks/make_docs.py` (never edit it by hand)"


def test_check_mode_passes_on_the_committed_page():
    res = subprocess.run([sys.executable, "benchmarks/make_docs.py", "--check"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_changed_result_changes_the_page(bench, monkeypatch):
    """The page is read from the files: editing a number in a results file shows on the page."""
    _, make_docs = bench
    before = make_docs.render()
    real = make_docs.Json.load

    def edited(self):
        doc = real(self)
        if self.file == make_docs.SLICE_V4.file:
            doc = json.loads(json.dumps(doc).replace('"step_ms": 57.072', '"step_ms": 99.999'))
        return doc

    monkeypatch.setattr(make_docs.Json, "load", edited)
    after = make_docs.render()
    assert "99.999" not in before and before != after and "100.00 ms" in after


def test_paths_pick_one_row_and_ratios_stay_in_one_file(bench):
    _, make_docs = bench
    doc = {"rows": [{"engine": "a", "batch": 1, "ms": 2.0}, {"engine": "b", "batch": 1, "ms": 4.0},
                    {"engine": "a, b", "batch": 2, "ms": 1.0}]}
    assert make_docs.V("rows[engine=a,batch=1].ms", "{:.1f}").render(doc) == "2.0"
    assert make_docs.V('rows[engine="a, b"].ms', "{:.1f}").render(doc) == "1.0"
    assert make_docs.Sum("rows[batch=1].ms", "{:.0f}").render(doc) == "6"
    ratio = make_docs.Ratio(make_docs.V("rows[engine=b].ms"), make_docs.V("rows[engine=a,batch=1].ms"))
    assert ratio.render(doc) == "2.00x"
    with pytest.raises(ValueError, match="2 matches"):
        make_docs.V("rows[batch=1].ms").render(doc)
    with pytest.raises(ValueError, match="0 matches"):
        make_docs.V("rows[engine=c].ms").render(doc)


def test_every_table_source_exists_and_names_its_commit(bench):
    _, make_docs = bench
    for name in make_docs.quoted_files():
        assert (RESULTS / name).is_file(), name


def test_every_results_json_names_its_commit():
    """A hash, or null with a commit_note saying what is known (never missing, never free text)."""
    form = re.compile(r"[0-9a-f]{7,40}(-dirty)?")
    for p in sorted(RESULTS.glob("*.json")):
        record = json.loads(p.read_text())
        assert isinstance(record, dict) and "commit" in record, f"{p.name}: no commit"
        commit = record["commit"]
        if commit is None:
            assert record.get("commit_note"), f"{p.name}: commit null without a commit_note"
        else:
            assert form.fullmatch(commit), f"{p.name}: {commit!r}"


def _result_paths(text: str) -> set[str]:
    """Results files a page names by path (benchmarks/results/<file> or results/<file>), outside `git show` commands."""
    text = re.sub(r"git show [0-9a-f]{7,40}:\S+", "", text)
    return set(re.findall(r"results/(\d{4}-\d\d-\d\d-[A-Za-z0-9_.-]*[A-Za-z0-9])", text))


def test_pages_name_only_results_files_that_exist():
    """A file deleted from benchmarks/results/ is cited as `git show <commit>:benchmarks/results/<file>`."""
    missing = [f"{page.relative_to(REPO)}: {name}" for page in PAGES for name in sorted(_result_paths(page.read_text()))
               if not (RESULTS / name).exists() and not any(RESULTS.glob(name))]
    assert not missing, "\n".join(missing)


def test_git_show_citations_name_a_commit_that_has_the_file():
    cited = {m for page in PAGES for m in re.findall(r"git show ([0-9a-f]{7,40}):(benchmarks/results/[^\s`]+)",
                                                    page.read_text())}
    bad = []
    for commit, path in sorted(cited):
        res = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=REPO, capture_output=True)
        if res.returncode != 0:
            bad.append(f"{commit}:{path}")
    assert not bad, "\n".join(bad)


def _tables(text: str) -> list[list[str]]:
    tables, cur = [], []
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.lstrip().startswith("|"):
            cur.append(line.strip())
        elif cur:
            tables.append(cur)
            cur = []
    return tables + ([cur] if cur else [])


def _cells(line: str) -> int:
    return len(re.split(r"(?<!\\)\|", line.strip().strip("|")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_tables_are_well_formed(page):
    for table in _tables(page.read_text()):
        assert len(table) >= 2 and re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", table[1]), table[:2]
        width = _cells(table[0])
        assert all(_cells(line) == width for line in table), "\n".join(table)


def test_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


# ---- a results file is never overwritten ----

def test_write_results_refuses_an_existing_file(bench, tmp_path):
    common, _ = bench
    path = tmp_path / "sub" / "r.json"
    assert common.write_results(path, "{}\n") == path and path.read_text() == "{}\n"
    with pytest.raises(FileExistsError, match=re.escape(str(path))):
        common.write_results(path, '{"x": 1}\n')
    assert path.read_text() == "{}\n"


def test_new_results_path_and_out_argument_refuse_an_existing_file(bench, tmp_path):
    import argparse

    common, _ = bench
    path = tmp_path / "r.json"
    assert common.new_results_path(path) == path
    common.refuse_existing_out(argparse.Namespace(out=None))
    path.write_text("{}")
    with pytest.raises(FileExistsError, match="never overwritten"):
        common.new_results_path(path)
    with pytest.raises(FileExistsError, match=re.escape(str(path))):
        common.refuse_existing_out(argparse.Namespace(out=str(path)))


def test_a_benchmark_stops_before_measuring_when_its_out_exists(tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("kept")
    res = subprocess.run([sys.executable, "benchmarks/plan_time.py", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert res.returncode != 0 and f"{out}: results file exists" in res.stderr
    assert out.read_text() == "kept"


def test_every_script_with_out_checks_it_before_measuring():
    scripts = [p for p in sorted(BENCH.glob("*.py"))
               if '"--out"' in p.read_text() and "from common import" in p.read_text()]
    assert len(scripts) >= 15
    for p in scripts:
        src = p.read_text()
        parse = src.index("parse_args()\n", src.index("def main"))
        assert src.index("refuse_existing_out(args)") > parse, p.name
