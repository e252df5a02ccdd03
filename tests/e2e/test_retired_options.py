"""Options a command gave up are accepted for a release (cli_options.retired): hidden from --help,
doing nothing, one note line on stderr each; stdout and the exit status are the command's without
them. verify --only and --skip-unsupported were given up by issue 38 (before, "No such option")."""
import re

import pytest

from ckptconv import cli
from tests.helpers import ROOT, run

NOTE = "ckptconv: note: verify {} no longer does anything ({}); it will be removed in the next release\n"
ONLY = NOTE.format("--only", "verify --against reads the part of the source the output records it was made "
                             "from: convert's own --only")
SKIP = NOTE.format("--skip-unsupported", "verify --against reads what safetensors cannot store as facts of the "
                                         "source, compared with what the output records as skipped, never a refusal")


@pytest.fixture(scope="module")
def converted(hf_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("retired") / "out"
    r = run("convert", hf_llama["dir"], out, "--max-shard-size", "60KB", "--only", "model.layers.0", "--quiet")
    assert r.exit_code == 0, r.stderr
    return out


@pytest.mark.parametrize("given, notes", [
    (["--skip-unsupported"], SKIP),
    (["--only", "model.layers.1", "--only", "lm_head"], ONLY),
    (["--only", "model.embed_tokens", "--skip-unsupported"], ONLY + SKIP),
], ids=["skip-unsupported", "only-twice", "both"])
@pytest.mark.parametrize("json_", [False, True], ids=["text", "json"])
def test_a_retired_verify_option_is_accepted_with_one_note_and_changes_nothing(converted, hf_llama, given, notes,
                                                                             json_):
    args = ["verify", converted, "--against", hf_llama["dir"], *(["--json"] if json_ else [])]
    plain = run(*args)
    assert plain.exit_code == 0 and plain.stderr == "", plain.stderr
    r = run(*args, *given)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == plain.stdout
    assert r.stderr == notes
    assert ("matches the source" in plain.stdout) != json_


def test_a_retired_option_keeps_the_command_s_failure_and_its_one_error_line(tmp_path):
    r = run("verify", tmp_path / "absent", "--skip-unsupported")
    assert r.exit_code == 2
    assert r.stderr.splitlines()[0] + "\n" == SKIP and len(r.stderr.splitlines()) == 2
    assert r.stderr.splitlines()[1].startswith("ckptconv: error: ")


def _retired():
    """(command, flag) of every retired option: the hidden options no command function receives."""
    return sorted((name, opt) for name, command in cli.main.commands.items() for p in command.params
                  if getattr(p, "hidden", False) and not p.expose_value for opt in p.opts)


def test_retired_options_are_hidden_from_help_and_listed_in_the_docs():
    found = _retired()
    assert ("verify", "--only") in found and ("verify", "--skip-unsupported") in found
    table = (ROOT / "docs" / "README.md").read_text().split("## Retired options", 1)[1]
    for name, flag in found:
        assert run(name, "--help").stdout.count(flag) == 0, flag
        assert re.search(rf"^\| {name} \| `{flag}[ `]", table, re.M), (name, flag)
        assert flag in (ROOT / "docs" / f"{name}.md").read_text()
