"""Every file a docstring or comment of the package names exists.

The package's folders are the ones pyproject.toml maps into the weightsync namespace. A name
with a folder (`server/store/node_store.py`, `docs/data-plane.md`, `weightsync/v1/local.proto`) is
read from the repository root (a .proto also from protos/); a bare name (`receiver.py`) from
the folder of the file that names it, or the root (`README.md`); a bare .proto from
protos/weightsync/v1. A file renamed or removed without its mentions fails here, naming them.
Files of other projects named on purpose (vLLM's, googleapis') are listed in ELSEWHERE.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"

ELSEWHERE = {
    "vllm/triton_utils/dispatcher.py": "vLLM's source (engine/vllm_plugin.py works around its kernel scan)",
    "status.proto": "googleapis' google/rpc/status.proto (the rich error model)",
    "error_details.proto": "googleapis' google/rpc/error_details.proto (ErrorInfo)",
}
"""Named files that are not this repository's, and whose they are."""

FILE_NAME = re.compile(
    r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|proto|toml|ya?ml|json|sh|txt|cfg|ini))(?![\w/-])"
)
"""A file name with one of the extensions this repository's files have, with or without folders;
not the tail of a longer path or address."""

WRAPPED = re.compile(r"/[ \t]*\n[ \t]*(?:#[ \t]*)?")
"""A path cut after a slash at the end of a line (of a docstring, or of one comment block)."""


def package_sources() -> list[Path]:
    """The Python files of the folders pyproject.toml maps into the weightsync namespace."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return sorted({path for folder in setuptools["package-dir"].values() for path in (ROOT / folder).rglob("*.py")})


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each docstring (any string statement: module, class, function, attribute)
    and each block of comments on consecutive lines."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value
    block: list[str] = []
    start = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if block and line != last + 1:
            yield start, "\n".join(block)
            block = []
        if not block:
            start = line
        block.append(token.string)
        last = line
    if block:
        yield start, "\n".join(block)


def named_files(source: str) -> Iterator[tuple[int, str]]:
    """(line, name) of each file name in the prose of a Python source."""
    for line, text in prose(source):
        for name in FILE_NAME.findall(WRAPPED.sub("/", text)):
            yield line, name


def resolves(name: str, folder: Path) -> bool:
    """Whether `name`, named in a file of `folder`, is a file (or folder) of this repository."""
    if "/" in name:
        places = [ROOT / name, PROTOS / name]
    else:
        places = [folder / name, ROOT / name, PROTOS / "weightsync" / "v1" / name]
    return any(place.exists() for place in places)


@functools.cache
def package_names() -> dict[Path, list[tuple[int, str]]]:
    """Each package source and the (line, name) of the files its prose names (read once)."""
    return {path: list(named_files(path.read_text())) for path in package_sources()}


def test_every_file_named_in_the_package_prose_exists():
    sources = package_names()
    assert len(sources) > 100 and ROOT / "gpu_worker" / "worker.py" in sources  # the whole package is read
    missing = [f"{path.relative_to(ROOT)}:{line}: {name}" for path, names in sources.items() for line, name in names
               if name not in ELSEWHERE and not resolves(name, path.parent)]
    assert missing == []


def test_every_elsewhere_entry_is_still_named():
    """An entry nothing names any more goes: the list says which outside files the prose points at."""
    named = {name for names in package_names().values() for _, name in names}
    assert sorted(set(ELSEWHERE) - named) == []


def test_the_check_finds_names_in_docstrings_comments_and_wrapped_lines(tmp_path):
    source = (
        '"""A join is bounded by its deadline (see groups.py); the framing is in common/\n'
        'local_wire.py, the messages in weightsync/v1/local.proto."""\n'
        "\n"
        "# see server/no_such_module.py and docs/data-plane.md#reasons, not\n"
        "# https://example.com/docs/elsewhere.md\n"
        "X = 1\n"
        'Y = "server/not_prose.py"\n'
        '"""Y: written in bench/results/no_such_result.md."""\n'
    )
    assert sorted(named_files(source)) == [
        (1, "common/local_wire.py"), (1, "groups.py"), (1, "weightsync/v1/local.proto"),
        (4, "docs/data-plane.md"), (4, "server/no_such_module.py"), (8, "bench/results/no_such_result.md"),
    ]
    module = ROOT / "gpu_worker" / "example_prose.py"  # resolved as if it sat beside worker.py
    names = {name: resolves(name, module.parent) for _, name in named_files(source)}
    assert names == {
        "groups.py": False, "common/local_wire.py": True, "weightsync/v1/local.proto": True,
        "docs/data-plane.md": True, "server/no_such_module.py": False, "bench/results/no_such_result.md": False,
    }
    assert resolves("receiver.py", ROOT / "gpu_worker") and not resolves("receiver.py", ROOT / "client")
    assert resolves("tensor.proto", ROOT / "client") and resolves("README.md", ROOT / "engine")
