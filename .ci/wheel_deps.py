"""Make a wheel's declared dependencies, and nothing else, visible to another environment.

    python .ci/wheel_deps.py WHEEL DEST [EXTRA ...]

Run by the interpreter whose environment holds the dependencies (a system Python, a virtual
environment or a conda environment: `bash rheo.sh setup` installed them there). It reads the
wheel's Requires-Dist (with the EXTRAs named, as `pip install "WHEEL[EXTRA]"` would), follows
each distribution's own requirements (with the extras asked of it) through this environment's
installed metadata, and links the top-level files of every distribution in that closure into
DEST. A new environment that adds DEST to its path
(`site.addsitedir`, from a .pth file) then sees what `pip install WHEEL` would have given a
user, from the copies already installed here: no download, and the same torch build (CPU or
CUDA) the user has. A requirement that is missing here, or whose installed version its
specifier refuses, is an error naming it: nothing is guessed.

Prints one line per distribution linked ("name version").
"""

from __future__ import annotations

import os
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # packaging is not a runtime dependency; pip always vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def wheel_requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(name).decode())
    return meta.get_all("Requires-Dist") or []


def wanted(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req`` applies here, for a distribution asked for with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in extras | {""})


def top_level(dist: metadata.Distribution) -> set[str]:
    """The names ``dist`` put beside other packages in its site directory (packages, modules,
    .pth files, its .dist-info folder)."""
    if dist.files is not None:
        names = {f.parts[0] for f in dist.files if f.parts}
        return {n for n in names if n not in ("..", "__pycache__") and not n.startswith("/")}
    listed = dist.read_text("top_level.txt")
    if listed is None:
        sys.exit(f"wheel_deps: {dist.metadata['Name']} {dist.version} lists no files (no RECORD "
                 "nor top_level.txt); reinstall it with pip")  # fmt: skip
    info = Path(str(dist._path)).name  # type: ignore[attr-defined]
    return {n.strip() for n in listed.splitlines() if n.strip()} | {info}


def main(wheel: str, dest: str, extras: set[str]) -> None:
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    todo = [(Requirement(r), extras, "the wheel") for r in wheel_requirements(wheel)]
    seen: dict[str, set[str]] = {}
    while todo:
        req, parent_extras, by = todo.pop()
        if not wanted(req, parent_extras):
            continue
        key = canonicalize_name(req.name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            sys.exit(f"wheel_deps: {req} (required by {by}) is not installed for "
                     f"{sys.executable}; install it there first (bash rheo.sh setup installs "
                     "every dependency)")  # fmt: skip
        if not req.specifier.contains(dist.version, prereleases=True):
            sys.exit(f"wheel_deps: {req.name} {dist.version} is installed for {sys.executable} "
                     f"but {by} requires {req}; install a version it accepts (constraints.txt "
                     "pins one)")  # fmt: skip
        extras = set(req.extras)
        if key in seen and extras <= seen[key]:
            continue
        first = key not in seen
        seen.setdefault(key, set()).update(extras)
        for r in dist.requires or []:
            todo.append((Requirement(r), extras, f"{dist.metadata['Name']} {dist.version}"))
        if not first:
            continue
        for name in sorted(top_level(dist)):
            src = Path(str(dist.locate_file(name)))
            link = out / name
            if src.exists() and not link.exists():
                os.symlink(src, link)
        print(dist.metadata["Name"], dist.version)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python .ci/wheel_deps.py WHEEL DEST [EXTRA ...]")
    main(sys.argv[1], sys.argv[2], set(sys.argv[3:]))
