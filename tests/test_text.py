"""Text a reader cannot act on: the docs, README, CHANGELOG, recipes and the code name no internal issue or task
numbers (readers cannot look them up) and point to no file outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = [
    p
    for pattern in ("*.md", "docs/**/*.md", "recipes/**/*", "hf_dtrain/**/*.py", "benchmarks/*.py", "tests/**/*.py")
    for p in ROOT.glob(pattern)
    if p.is_file() and p.suffix in (".md", ".py", ".yaml", ".yml")
]
INTERNAL = re.compile(r"""\b(?:issue|task)s?\s+#?\d+\b|(?<![\w/&"'])#\d{2,3}\b(?![0-9a-fA-F])""", re.IGNORECASE)
OUTSIDE = re.compile(r"\.\./shared/(?!data/)")  # the shared data sets are read where they live; nothing else is


def test_no_internal_issue_numbers_or_paths_outside_the_repository():
    assert len(TEXT) > 100, "the glob found too few files; the paths above are wrong"
    found = []
    for path in TEXT:
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in (INTERNAL, OUTSIDE):
                m = pattern.search(line)
                if m:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not found, "text readers cannot follow:\n" + "\n".join(found)
