"""Check that pip installed the stack CI means to test, and print it.

CI tests two stacks (``.ci/run``): ``pinned``, the ``dev`` extra's ``==`` pins in ``pyproject.toml`` (the stack
the committed records were measured on), and ``newest``, the newest releases pip resolves, held by the floors of
``.ci/newest.txt`` to a minor release each. The install sections of the README and of *Getting started* name
both (``tests/test_stack.py`` reads them from here), so a stack that pip resolves otherwise fails here, naming
the file to update, rather than leaving the pages wrong.

Usage: ``python .ci/check_stack.py pinned|newest``. Importing each package also loads its compiled libraries
(torchaudio's among them), so a pair that cannot run together fails here, before the tests.
"""

from __future__ import annotations

import importlib
import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
NEWEST = ROOT / ".ci" / "newest.txt"
#: How the README names each package.
NAMES = {"torch": "torch", "torchvision": "torchvision", "torchaudio": "torchaudio", "lightning": "Lightning"}


def _release(version: str) -> tuple[int, ...]:
    """``(2, 15, 0)`` from ``"2.15.0+cu132"``."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def stack(name: str) -> list[tuple[str, str, str]]:
    """The stack ``name`` (``pinned`` or ``newest``) as ``(package, operator, version)``, in file order."""
    if name == "pinned":
        extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
        lines = [d.split("#")[0].strip() for d in extra]
    elif name == "newest":
        lines = [line.split("#")[0].strip() for line in NEWEST.read_text().splitlines()]
    else:
        raise SystemExit(f"check_stack: unknown stack {name!r}: use 'pinned' or 'newest'")
    wanted = "==" if name == "pinned" else ">="
    found = [re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(==|>=)\s*([0-9.]+)", line) for line in lines if line]
    return [(m[1], m[2], m[3]) for m in found if m and m[2] == wanted and m[1] in NAMES]


def described(name: str) -> str:
    """The stack as the README names it: ``torch 2.11.0``, or the minor release for the newest (``torch 2.15``)."""
    parts = [
        f"{NAMES[package]} {version if op == '==' else '.'.join(version.split('.')[:2])}"
        for package, op, version in stack(name)
    ]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def readme_sentence() -> str:
    """The sentence of the install sections (README, *Getting started*) that says what CI tests."""
    return f"CI tests {described('pinned')} (`dev`); {described('newest')} (newest)."


def problems(name: str) -> list[str]:
    """What differs between the installed packages and the stack ``name``; empty when they match."""
    source = "the dev extra in pyproject.toml" if name == "pinned" else ".ci/newest.txt"
    found = []
    for package, op, version in stack(name):
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            found.append(f"{package} is not installed; {source} asks for {package}{op}{version}")
            continue
        if op == "==":
            ok = _release(installed) == _release(version)
        else:
            ok = _release(installed) >= _release(version) and _release(installed)[:2] == _release(version)[:2]
        if not ok:
            found.append(
                f"pip installed {package} {installed}, and {source} says {package}{op}{version}: test the new"
                f" release, then name it in {source} and in the README's and getting-started's install sections (tests/test_stack.py)"
            )
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    name = argv[0]
    found = problems(name)
    for package, _, _ in stack(name):
        module = importlib.import_module(package)  # loads its libraries: a pair that cannot run together fails
        print(f"{name} stack: {package} {getattr(module, '__version__', metadata.version(package))}")
    for problem in found:
        print(f"check_stack ({name}): {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
