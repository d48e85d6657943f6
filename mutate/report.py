"""`make mutate`'s summary of a mutmut run: counts per file and every mutant not killed,
with its diff, as markdown (benchmarks/results/mutation.md is written from it).

Run in the directory mutmut ran in (.mutate/), with mutmut's interpreter:
`python ../mutate/report.py GLOB...`, the same mutant-name globs `mutmut run` was given.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

COLUMNS = ("killed", "survived", "timeout", "no tests", "suspicious", "not checked")


def main(globs: list[str]) -> int:
    rows: list[tuple[str, Counter[str]]] = []
    left: list[tuple[str, str, str]] = []  # (status, mutant, path): run and not killed
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        path = meta.relative_to("mutants").with_suffix("")
        codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
        counts: Counter[str] = Counter()
        for name, code in sorted(codes.items()):
            if globs and not any(fnmatch.fnmatch(name, g) for g in globs):
                continue
            status = status_by_exit_code[code]
            counts[status] += 1
            if status not in ("killed", "not checked"):
                left.append((status, name, str(path)))
        if counts:
            rows.append((str(path).removeprefix("src/vllm_router/"), counts))

    total: Counter[str] = Counter()
    print("| file | mutants | " + " | ".join(COLUMNS) + " |")
    print("|---|---:|" + "---:|" * len(COLUMNS))
    for name, counts in rows:
        total.update(counts)
        cells = " | ".join(str(counts[c]) for c in COLUMNS)
        print(f"| {name} | {sum(counts.values())} | {cells} |")
    cells = " | ".join(str(total[c]) for c in COLUMNS)
    print(f"| **all** | {sum(total.values())} | {cells} |")
    other = set(total) - set(COLUMNS)
    if other:
        print(f"\nother statuses: {dict((s, total[s]) for s in sorted(other))}")

    for status, name, path in left:
        print(f"\n### {status}: `{name}`\n\n```diff")
        try:
            print(get_diff_for_mutant(name, path=path))
        except Exception as exc:  # a report line, not a reason to lose the rest
            print(f"(no diff: {type(exc).__name__}: {exc})")
        print("```")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
