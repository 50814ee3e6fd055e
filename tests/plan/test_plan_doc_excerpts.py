"""The `lowcomm plan` excerpts of docs/comparing.md are the code's output: each block of its
plan sections that starts with a `lowcomm plan` command is that command, re-run here in the
test's process, and each run of the block's lines between `...` marks must be consecutive lines
of what it prints now. When the plan's answer changes, paste the new lines into the doc."""
import re
import shlex
from pathlib import Path

import pytest

from lowcomm.cli.main import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "comparing.md"
SECTIONS = ("## `lowcomm plan`", "### Tuning each strategy: `--tune`")  # the parts the excerpts live in


def plan_blocks() -> list[list[str]]:
    """Each fenced block of the plan sections whose first line is a `lowcomm plan` command."""
    text = DOC.read_text()
    start = text.index(SECTIONS[0])
    end = text.index("\n## ", start + 1) if "\n## " in text[start + 1:] else len(text)
    blocks = re.findall(r"^```\n(.*?)^```", text[start:end], flags=re.S | re.M)
    return [b.splitlines() for b in blocks if b.startswith("lowcomm plan ")]


def excerpts(block: list[str]) -> list[list[str]]:
    """The runs of lines between `...` marks."""
    runs, run = [], []
    for line in block[1:]:
        if line.strip() == "...":
            runs, run = runs + [run] * bool(run), []
        else:
            run.append(line.rstrip())
    return runs + [run] * bool(run)


def test_the_doc_shows_tune_excerpts():
    blocks = plan_blocks()
    assert any("--tune" in b[0] for b in blocks) and all(excerpts(b) for b in blocks), blocks


@pytest.mark.parametrize("block", plan_blocks(), ids=lambda b: b[0][len("lowcomm plan "):][:60])
def test_each_plan_excerpt_is_what_the_command_prints(capsys, block):
    assert main(shlex.split(block[0])[1:]) == 0
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    for run in excerpts(block):
        at = [i for i in range(len(printed) - len(run) + 1) if printed[i:i + len(run)] == run]
        assert at, ("docs/comparing.md shows lines the command no longer prints:\n" + "\n".join(run)
                    + "\n\nit prints:\n" + "\n".join(printed))
