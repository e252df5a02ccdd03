"""Every example in docs/ runs, and prints what its page shows (issue 30, item 8).

What an example is. A fenced block (```) of a page in docs/ holding lines that start with `$ `: each
such line is a command as a user types it, and the lines after it, up to the next `$ ` line or the
end of the block, are what the page shows it printing (nothing shown: it must print nothing). A
fenced block that holds a `ckptconv …` line without the prompt is a command too: it must be written
as an example, or opt out (below).

How a page's examples run. In a fresh empty directory, in which the page's generator
(tests/fixtures/docs_inputs.py, PAGES) first makes every input the commands name (and may return
environment variables they run with: docs/storage.md's bucket endpoint); then every command
of the page in order, as `bash -c` would run it there (a page's examples may build on each other).
`ckptconv` is this checkout: a command that is nothing but `ckptconv ARGS` (or several joined with
`&&`) runs in this process through click's CliRunner, which shows stdout and stderr together as a
terminal does, with no progress bars (stderr is not a terminal: as with `--quiet`); one that uses
`--device` (JAX fixes its devices once it starts) or anything else of the shell (`cd`, `sha256sum`,
`ls`, globs, pipes) runs under bash, with `ckptconv` on PATH meaning `python -m ckptconv.cli` of this
checkout and stdout and stderr in one pipe, unbuffered.

What must match. The command's exit status: 2 when the page shows a `ckptconv: error:` line, 1 when
it shows verify's `PATH: N problem(s): …` line, else 0. And its output, line by line, trailing
spaces ignored, exactly, except for these, and nothing else:
- timings: `0.01 s (0.03 GB/s)` in a page's line stands for any `D.DD s (D.DD GB/s)` (convert's time
  and rate), `in 0.04 s` ending a line for any `in D.DD s` there (reshard's time), and
  `placed at 0.02 GB/s` for any rate there (verify --device); plan's estimates are compared;
- elided digests: `sha256:f8dd…a195` (hex digits, `…`, hex digits) stands for any full digest,
  `sha256:` and 64 hex digits; a later command of the page that names the same elided digest gets
  the one the run printed in its place (`ckptconv verify out --expect sha256:f8dd…a195`);
- excerpts: a line that is only `…` stands for any number of lines (none included); a `…` elsewhere
  in a line for any text within that line (`extras: {"args": …}`, `replicated: a, b, …`). What a
  page shows around `…` is compared as it is.
The real output's own lines are never rewritten: names, counts, sizes, messages are compared as the
page spells them.

Opting out. A block that cannot run here (CUDA devices, several hosts, a 318 GB model) is preceded,
on the line right before its opening fence, by a visible marker that says why:
`<!-- not run: REASON -->`. A marker anywhere else fails the test. No example may write into
`demo-out/`, where `make demo` (scripts/demo.py) writes.

When an example fails, the message shows the page's lines and what the command really printed, with
the page's line number: paste the real output into the page when it is right, fix the tool when it
is not.
"""
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptconv.cli import main
from tests.helpers import ROOT

DOCS = ROOT / "docs"
MARKER = re.compile(r"<!-- not run: (\S.*\S) -->")
DEMO_OUT = "demo-out"   # scripts/demo.py's WORK


@dataclass
class Command:
    line: int                 # of the `$ ` line in the page (1-based)
    text: str                 # what follows `$ `
    shown: list = field(default_factory=list)


@dataclass
class Block:
    line: int                 # of the opening fence
    commands: list            # Commands (`$ ` lines)
    bare: list                # `ckptconv …` lines without the prompt
    skip: str = None          # the marker's reason


def parse(page: Path):
    """(blocks holding commands, misplaced markers) of a page."""
    lines = page.read_text().splitlines()
    blocks, markers_used, i = [], set(), 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        start, indent = i, len(lines[i]) - len(lines[i].lstrip())
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append((i + 1, lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip()))
            i += 1
        i += 1
        commands, bare = [], []
        for number, text in body:
            if text.startswith("$ "):
                commands.append(Command(number, text[2:]))
            elif commands:
                commands[-1].shown.append(text.rstrip())
            elif text.startswith("ckptconv "):
                bare.append((number, text))
        if not commands and not bare:
            continue
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.fullmatch(lines[before].strip()) if before >= 0 and before == start - 1 else None
        if marker:
            markers_used.add(before)
        blocks.append(Block(start + 1, commands, bare, marker and marker.group(1)))
    misplaced = [n + 1 for n, text in enumerate(lines) if text.strip().startswith("<!-- not run")
                 and n not in markers_used]
    return blocks, misplaced


PAGES = sorted(DOCS.glob("*.md"))
PARSED = {p.name: parse(p) for p in PAGES}
RUN = sorted(name for name, (blocks, _) in PARSED.items() if any(b.commands and not b.skip for b in blocks))


# -- comparing ------------------------------------------------------------------------------------------------

ELIDED = re.compile(r"sha256:[0-9a-f]*…[0-9a-f]*")
TIMED = [r"\d+\.\d\d s \(\d+\.\d\d GB/s\)",    # convert: "0.01 s (0.03 GB/s)"
         r"in \d+\.\d\d s$",                    # reshard: "…, 167.68 KB in 0.04 s" (ending the line)
         r"placed at \d+(?:\.\d+)? GB/s"]        # verify --device
SPECIAL = re.compile(f"({ELIDED.pattern})|({'|'.join(TIMED)})|(…)")


def line_pattern(shown: str):
    """The regular expression a page's line stands for, and the elided digests in it, in order."""
    parts, elided, at = [], [], 0
    for m in SPECIAL.finditer(shown):
        parts.append(re.escape(shown[at:m.start()]))
        if m.group(1):
            parts.append(f"(?P<d{len(elided)}>sha256:[0-9a-f]{{64}})")
            elided.append(m.group(1))
        elif m.group(2):
            parts.append(next(t.rstrip("$") for t in TIMED if re.fullmatch(t.rstrip("$"), m.group(2))))
        else:
            parts.append(".*?")
        at = m.end()
    parts.append(re.escape(shown[at:]))
    return re.compile("".join(parts)), elided


def match(shown: list, real: list):
    """The digests the page elides, as the run printed them ({elided: full}), or None when the real
    lines are not what the page shows."""
    pats = [None if s.strip() == "…" else line_pattern(s) for s in shown]
    memo = {}

    def go(i, j):   # shown[i:] against real[j:]: the bindings, or None
        if (i, j) in memo:
            return memo[i, j]
        if i == len(pats):
            found = {} if j == len(real) else None
        elif pats[i] is None:   # a gap: none or more lines
            found = go(i + 1, j)
            if found is None and j < len(real):
                found = go(i, j + 1)
        elif j < len(real) and (m := pats[i][0].fullmatch(real[j])):
            found = go(i + 1, j + 1)
            if found is not None:
                found = {**found, **{e: m.group(f"d{k}") for k, e in enumerate(pats[i][1])}}
        else:
            found = None
        memo[i, j] = found
        return found

    return go(0, 0)


def expected_status(shown: list) -> int:
    if any(s.startswith("ckptconv: error:") for s in shown):
        return 2
    if any(re.match(r"\S.*: \d+ problem\(s\): ", s) for s in shown):
        return 1
    return 0


# -- running ----------------------------------------------------------------------------------------------------

def outside_quotes(text: str) -> str:
    """The characters of a command line outside quotes, up to a comment."""
    out, quote = [], None
    for k, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (k == 0 or text[k - 1].isspace()):
            break
        else:
            out.append(c)
    return "".join(out)


def in_process(text: str):
    """The argument lists of a command line that is only `ckptconv ARGS [&& ckptconv ARGS …]`, without
    --device; else None (it runs under bash)."""
    bare = outside_quotes(text)
    if set(bare) & set("|;<>()$`*?[]{}~!\\") or bare.replace("&&", "").count("&"):
        return None
    argvs, tokens = [[]], shlex.split(text, comments=True)
    for token in tokens:
        if token == "&&":
            argvs.append([])
        else:
            argvs[-1].append(token)
    if not all(argv and argv[0] == "ckptconv" and "--device" not in argv for argv in argvs):
        return None
    return [argv[1:] for argv in argvs]


def execute(text: str, work: Path, shim: Path):
    """(exit status, output lines) of a page's command run in `work`."""
    argvs = in_process(text)
    if argvs is not None:
        output, code = "", 0
        for argv in argvs:
            r = CliRunner().invoke(main, argv, prog_name="ckptconv", catch_exceptions=False)
            output, code = output + r.output, r.exit_code
            if code:
                break
    else:
        env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
               "PYTHONUNBUFFERED": "1"}
        r = subprocess.run(["bash", "-c", text], cwd=work, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
        output, code = r.stdout, r.returncode
    lines = [line.rstrip() for line in output.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return code, lines


def substitute(text: str, digests: dict) -> str:
    """A command with the page's elided digests replaced by those the run printed in their place."""
    return ELIDED.sub(lambda m: digests[m.group(0)], text)   # (KeyError: none printed before)


# -- the tests -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", RUN)
def test_examples_print_what_the_page_shows(page, tmp_path, monkeypatch):
    from tests.fixtures.docs_inputs import PAGES as GENERATORS
    work, shim = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    shim.mkdir()
    (shim / "ckptconv").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m ckptconv.cli \"$@\"\n")
    (shim / "ckptconv").chmod(0o755)
    env = GENERATORS[page](work)
    for name, value in (env or {}).items():   # (a page's own environment: docs/storage.md's endpoint)
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(work)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    digests, failures = {}, []
    for block in PARSED[page][0]:
        if block.skip:
            continue
        for command in block.commands:
            where = f"docs/{page}:{command.line}: $ {command.text}\n"
            try:
                text = substitute(command.text, digests)
            except LookupError as e:
                failures.append(where + f"{e.args[0]}: no output before it on the page printed this digest\n")
                continue
            code, real = execute(text, work, shim)
            found = match(command.shown, real)
            want = expected_status(command.shown)
            if found is None or code != want:
                failures.append(where + (f"exit status {code}, expected {want}\n" if code != want else "")
                                + "--- the page shows:\n" + "".join(f"  {s}\n" for s in command.shown)
                                + "--- it printed:\n" + "".join(f"  {s}\n" for s in real))
            else:
                digests.update(found)
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


def test_every_page_with_examples_has_a_generator():
    from tests.fixtures.docs_inputs import PAGES as GENERATORS
    assert sorted(GENERATORS) == RUN


def test_every_command_shown_runs_or_says_why_not():
    """A `ckptconv` line shown without the prompt is not an example: every such block opts out by
    name, and every marker stands right before a block of commands."""
    problems = []
    for name, (blocks, misplaced) in PARSED.items():
        problems += [f"docs/{name}:{n}: a `<!-- not run: REASON -->` marker not right before a block of commands, "
                     "or without its reason" for n in misplaced]
        problems += [f"docs/{name}:{b.line}: `{b.bare[0][1]}` is shown without `$ ` and its output: write it as "
                     "an example, or mark the block `<!-- not run: REASON -->`"
                     for b in blocks if b.bare and not b.skip]
    assert not problems, "\n".join(problems)


def test_no_example_writes_where_make_demo_does():
    named = [f"docs/{name}:{c.line}: {c.text}" for name, (blocks, _) in PARSED.items() for b in blocks
             for c in b.commands if DEMO_OUT in c.text]
    assert not named, "\n".join(named)


@pytest.mark.parametrize("shown,real,ok", [
    (["wrote out: 2 tensors, 256 B in 3 files, 0.01 s (0.00 GB/s)"],
     ["wrote out: 2 tensors, 256 B in 3 files, 12.34 s (1.50 GB/s)"], True),
    (["wrote out: 2 tensors, 256 B in 3 files, 0.01 s (0.00 GB/s)"],
     ["wrote out: 2 tensors, 257 B in 3 files, 0.01 s (0.00 GB/s)"], False),
    (["wrote tp2/: 2 ranks (llama rules, 6 tensors split, 3 replicated), 24.06 KB in 0.03 s"],
     ["wrote tp2/: 2 ranks (llama rules, 6 tensors split, 3 replicated), 24.06 KB in 1.25 s"], True),
    (["process 0: 1 rank dirs, reads 39.80 GB, writes 39.80 GB, peak RSS ~90 MiB, ~66.4 s"],
     ["process 0: 1 rank dirs, reads 39.80 GB, writes 39.80 GB, peak RSS ~90 MiB, ~66.5 s"], False),
    (["device cpu: 4 rank(s) on 4 device(s), 316.42 KB placed at 0.02 GB/s, …"],
     ["device cpu: 4 rank(s) on 4 device(s), 316.42 KB placed at 0.1 GB/s, global arrays assembled"], True),
    (["a", "…", "z"], ["a", "z"], True),
    (["a", "…", "z"], ["a", "b", "c", "z"], True),
    (["a", "…"], ["a", "b", "z"], True),
    (["a", "z"], ["a", "b", "z"], False),
    (["replicated: x, …"], ["replicated: x, y, z"], True),
    (["replicated: x, …"], ["replicated: y, z"], False),
    (["identity: sha256:ab…cd"], ["identity: sha256:" + "0" * 64], True),
    (["identity: sha256:ab…cd"], ["identity: sha256:" + "0" * 63], False),
    (["identity: sha256:ab…cd"], ["identity: sha256:xyz"], False),
    ([], [], True),
    ([], ["something"], False),
])
def test_the_comparison(shown, real, ok):
    assert (match(shown, real) is not None) == ok


def test_an_elided_digest_in_a_command_is_the_one_printed():
    found = match(["identity: sha256:ab…cd (check with: ckptconv verify out --expect sha256:ab…cd)"],
                  [f"identity: sha256:{'1' * 64} (check with: ckptconv verify out --expect sha256:{'1' * 64})"])
    full = "sha256:" + "1" * 64
    assert substitute("ckptconv verify out --expect sha256:ab…cd", found) == f"ckptconv verify out --expect {full}"
    with pytest.raises(KeyError):   # (a digest no earlier output printed)
        substitute("ckptconv verify out --expect sha256:ef…01", found)


@pytest.mark.parametrize("text,argvs", [
    ("ckptconv convert a b/ --dtype f16", [["convert", "a", "b/", "--dtype", "f16"]]),
    ("ckptconv inspect a.pt        # a comment", [["inspect", "a.pt"]]),
    ("ckptconv reshard m/ o/ --tp 2 -q && ckptconv verify o --against m/",
     [["reshard", "m/", "o/", "--tp", "2", "-q"], ["verify", "o", "--against", "m/"]]),
    ("ckptconv reshard moe/ tp2/ --tp 2 --allow-replicate '.*\\.moe\\..*'",
     [["reshard", "moe/", "tp2/", "--tp", "2", "--allow-replicate", ".*\\.moe\\..*"]]),
    ("(cd out && sha256sum -c SHA256SUMS)", None),
    ("ls out/", None),
    ("ckptconv verify tp4 --device cpu", None),
    ("ckptconv inspect *.pt", None),
    ("ckptconv inspect a.pt | head", None),
    ("ckptconv inspect a.pt & ckptconv inspect b.pt", None),
])
def test_what_runs_in_process(text, argvs):
    assert in_process(text) == argvs


def test_how_a_page_is_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "Text.", "```", "$ ckptconv inspect a.pt", "a.pt: torch", "  x  F32", "$ ls", "```",   # 2-7
        "<!-- not run: needs CUDA devices -->", "```", "ckptconv verify tp8 --device cuda", "```",   # 8-11
        "```", "ckptconv convert a b", "```",   # 12-14: a command without its output, not marked
        "<!-- not run: a stray marker -->", "",   # 15
        "- in a list:", "  ```", "  $ ckptconv convert a b", "  wrote b", "  ```",   # 18-21
        "```toml", "layout = 'torch'", "```"]) + "\n")
    blocks, misplaced = parse(page)
    assert [(b.line, b.skip, [(c.line, c.text, c.shown) for c in b.commands], b.bare) for b in blocks] == [
        (2, None, [(3, "ckptconv inspect a.pt", ["a.pt: torch", "  x  F32"]), (6, "ls", [])], []),
        (9, "needs CUDA devices", [], [(10, "ckptconv verify tp8 --device cuda")]),
        (12, None, [], [(13, "ckptconv convert a b")]),
        (18, None, [(19, "ckptconv convert a b", ["wrote b"])], [])]
    assert misplaced == [15]
