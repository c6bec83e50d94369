"""What the documentation says holds: every repository path that README.md, CONTRIBUTING.md,
docs/*.md and the notebooks cite exists, and the README's "Use" snippets run as pasted (on the CPU:
they compile and use no name they do not define; on a GPU: they run)."""

from __future__ import annotations

import ast
import builtins
import json
import re
from pathlib import Path

import pytest

from altup_cupy.lab import paths

ROOT = paths.REPO_ROOT
# A path relative to the repository root, as the documents write one: under a top-level folder
# (`altup_cupy/ops/collapse.py`, `results/<gpu name>/`, `tests/test_<op>.py`) or a top-level file.
CITED_PATH = re.compile(r"(?<![\w/.<-])((?:altup_cupy|scripts|tests|docs|results|notebooks|figures|\.ci)/[\w./<>*-]*"
                        r"|(?:README|CONTRIBUTING)\.md|pyproject\.toml|requirements\.txt)")


def _documents() -> dict[str, str]:
    """Document name -> its text (a notebook's cell sources and text outputs)."""
    texts = {p.name: p.read_text() for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md")}
    texts.update({f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))})
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        parts = ["".join(cell["source"]) for cell in cells]
        parts += ["".join(output.get("text", "")) for cell in cells for output in cell.get("outputs", ())]
        texts[f"notebooks/{path.name}"] = "\n".join(parts)
    return texts


def cited_paths(text: str) -> list[str]:
    """The repository paths `text` cites, as glob patterns: a placeholder (`<op>`) matches
    anything, and one cut short by a space (`<gpu name>`) leaves its folder."""
    found = []
    for match in CITED_PATH.finditer(text):
        path = re.sub(r"<[^>]*>", "*", match.group(1).rstrip(".,:;")).split("<")[0]
        found.append(path)
    return found


def test_the_citation_pattern():
    text = ("see `altup_cupy/ops/collapse.py`, [docs/SPEC.md](docs/SPEC.md). Results in results/<gpu name>/; "
            "tests/test_<op>_validation.py and scripts/gpu_run.sh: not my/altup_cupy/x.py")
    assert cited_paths(text) == ["altup_cupy/ops/collapse.py", "docs/SPEC.md", "docs/SPEC.md", "results/",
                                 "tests/test_*_validation.py", "scripts/gpu_run.sh"]


def test_every_cited_path_exists():
    documents = _documents()
    assert {"README.md", "CONTRIBUTING.md", "docs/SPEC.md"} <= set(documents)
    cited = {(name, path) for name, text in documents.items() for path in cited_paths(text)}
    assert len(cited) > 50, "the pattern finds (almost) nothing: it no longer matches how paths are written"
    missing = sorted((name, path) for name, path in cited if not any(ROOT.glob(path)) and not (ROOT / path).exists())
    assert not missing, f"cited paths that do not exist (document, path): {missing}"


def readme_use_snippets() -> list[str]:
    """The Python code blocks of the README's "Use" section."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def _undefined_names(code: str) -> set[str]:
    tree = ast.parse(code)
    bound, loaded = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return loaded - bound


def test_readme_use_snippets_compile_and_define_their_inputs():
    snippets = readme_use_snippets()
    assert len(snippets) >= 2, "the README's Use section lost its code"
    for code in snippets:
        compile(code, "README.md (Use)", "exec")
        assert not _undefined_names(code), f"a Use snippet uses names it never defines: {_undefined_names(code)}"


@pytest.mark.gpu
def test_readme_use_snippets_run():
    pytest.importorskip("transformers.models.gemma3n.modeling_gemma3n",
                        reason="the patch snippet needs transformers with Gemma 3n (the gemma3n extra)")
    import altup_cupy.gemma3n

    try:
        for code in readme_use_snippets():
            exec(compile(code, "README.md (Use)", "exec"), {})
    finally:
        altup_cupy.gemma3n.unpatch()
