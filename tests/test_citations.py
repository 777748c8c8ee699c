"""Citations name papers, not files outside the repository.

Docstrings and comments cite a method's paper by authors, year and arXiv id (with the section or equation),
e.g. "RocketKV (Behnam et al., 2025, arXiv:2502.14051), Sec. 3.6" — never a local copy of its text
(``papers/rocketkv.txt``, ``ems.txt``) or a working note (``METHODS.md``, ``../shared/...``), which a reader of
the repository does not have. Checked: every ``.py`` file under ``src/kvsieve`` and ``tests``, ``README.md``
and ``docs/*.md`` (``docs/results/`` holds generated outputs and is not checked).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvsieve"

#: Names of the papers' text files (and of other methods a stray ``<name>.txt`` could stand for).
_PAPER_STEMS = (
    "caote|ems|restkv|rest-kv|rocketkv|dbtrimkv|trimkv|snapkv|h2o|tova|quest|sparq|pyramidkv|adakv|streaming_?llm"
)
STALE_REFERENCE = re.compile(
    r"(?<![\w./-])papers/"  # a local papers/ folder (a URL such as hf.co/papers/<id> is not one)
    r"|shared/papers/"
    r"|METHODS\.md"
    r"|\.\./shared/"
    rf"|(?<![\w-])(?:{_PAPER_STEMS})\.txt\b",
    re.IGNORECASE,
)


def stale_references(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line that cites a file outside the repository."""
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if STALE_REFERENCE.search(line)]


def checked_files() -> list[Path]:
    files = sorted(SRC.rglob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [path for path in files if path.name != Path(__file__).name]


@pytest.mark.parametrize(
    "line",
    [
        "budgeted as RocketKV does (``papers/rocketkv.txt`` Sec. 3.6 and App. A).",
        '"""GQA reduction (METHODS.md, "GQA rule")."""',
        "* `../shared/METHODS.md` and the papers — what each method computes.",
        "# see ../shared/ARCHITECTURE.md",
        "EMS (ems.txt Sec. 4.2): merge into the nearest centre",
        "CAOTE (/work/shared/papers/caote.txt, Eq. 6)",
        "DBTrimKV (dbtrimkv.txt; TrimKV is Bui et al. 2025)",
    ],
)
def test_checker_flags_references_to_files_outside_the_repository(line):
    assert stale_references(f"x = 1\n{line}\n") == [(2, line.strip())]


@pytest.mark.parametrize(
    "line",
    [
        "budgeted as RocketKV (Behnam et al., 2025, arXiv:2502.14051) does (Sec. 3.6 and App. A.3).",
        "CAOTE (Goel et al., 2025, arXiv:2504.14051), Eq. 6",
        "https://huggingface.co/papers/2502.14051",
        "the locked set in ``requirements/constraints.txt``",
        'kvsieve generate --context doc.txt "question"',
        '"tokenizer.tiktoken", "vocab.txt")',
        'files = sorted(essays_dir().glob("*.txt"))',
    ],
)
def test_checker_passes_citations_and_other_txt_files(line):
    assert stale_references(line) == []


def test_sources_and_docs_cite_papers_not_local_files():
    files = checked_files()
    assert any(path.name == "snapkv.py" for path in files)  # the walk found the package
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line}"
        for path in files
        for number, line in stale_references(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, (
        "cite the paper itself (authors, year, arXiv id, section/equation), not a file outside the "
        "repository:\n" + "\n".join(offenders)
    )
