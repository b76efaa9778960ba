"""The docs show commands as they run after the README's install (``python3 -m venv .venv &&
.venv/bin/pip install -e ".[dev]"``), which puts nothing on PATH: every page that runs
``ravnest-jax`` or ``python`` (in a code block or an inline command) says once, near its top and
before its first command, to ``source .venv/bin/activate``; the README says it after the install."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ACTIVATE = "source .venv/bin/activate"
SHELLS = {"", "bash", "sh", "console", "shell", "text"}
_PREFIX = re.compile(r"^(\$ |\(|[A-Z_][A-Z0-9_]*=\S* |nice -n \d+ |cd \S+ && |time )+")


def _runs(cmd: str) -> bool:
    """Whether a shell line runs ravnest-jax or the venv's python (a bare ``python``)."""
    cmd = _PREFIX.sub("", cmd.strip())
    return cmd.startswith(("ravnest-jax ", "python ")) or cmd in ("ravnest-jax", "python")


def commands(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` of each command the page runs: shell lines of fenced blocks
    (not ```python ones), indented code lines, and inline code spans."""
    out, fence = [], None
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*```(\S*)", line)
        if m:
            fence = m.group(1).lower() if fence is None else None
            continue
        if fence is not None:
            if fence in SHELLS and _runs(line):
                out.append((i, line.strip()))
            continue
        if re.match(r"^ {4,}\S", line) and _runs(line):
            out.append((i, line.strip()))
        if not line.startswith("#"):  # a heading names a command, it does not run it
            out += [(i, span) for span in re.findall(r"`([^`]+)`", line) if _runs(span)]
    return out


def test_the_readme_says_to_activate_right_after_the_install():
    lines = (ROOT / "README.md").read_text().splitlines()
    install = next(i for i, ln in enumerate(lines) if "pip install -e" in ln)
    near = "\n".join(lines[install : install + 12])
    assert ACTIVATE in near, near


def test_every_page_that_runs_commands_says_to_activate_before_the_first():
    missing = {}
    for page in PAGES:
        text = page.read_text()
        cmds = commands(text)
        if not cmds:
            continue
        lines = text.splitlines()
        at = next((i for i, ln in enumerate(lines, 1) if ACTIVATE in ln), None)
        first = cmds[0][0]
        if at is None or at > first or (page.name != "README.md" and at > 12):
            missing[page.name] = (at, cmds[0])
    assert not missing, f"pages whose commands come before (or without) '{ACTIVATE}': {missing}"


def test_no_page_mixes_in_venv_paths_for_the_command_line():
    """One choice: activate once; not `.venv/bin/ravnest-jax` on some lines."""
    mixed = {p.name: ln for p in PAGES for ln in p.read_text().splitlines() if ".venv/bin/ravnest-jax" in ln}
    assert not mixed, mixed
