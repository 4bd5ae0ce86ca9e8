"""The training corpus of the default target: text every Python installation ships.

By default: the standard library's ``.py`` sources (``pydoc_data/topics.py``, the text of the
reference manual's topics, included), without the test suites, IDLE and installed packages, so
that the same Python version yields the same corpus on every machine. ``--corpus DIR`` replaces
it with every UTF-8 text file under DIR. Files are split into train and validation by a hash of
their relative path: stable when files are added or removed, and independent of the seed.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories of the standard library left out: test suites (much generated, repetitive data),
# IDLE (an application, not library code) and third-party packages (not the same everywhere).
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
VAL_FRACTION = 0.02


@dataclass(frozen=True)
class Corpus:
    """A sorted list of text files under ``root``, split by file into train and validation."""

    root: Path
    train: tuple[Path, ...]
    val: tuple[Path, ...]

    def describe(self) -> dict:
        """Provenance for train_log.json: where the text came from and a digest of all of it."""
        digest = hashlib.sha256()
        n_bytes = {"train": 0, "val": 0}
        for split, files in (("train", self.train), ("val", self.val)):
            for f in files:
                data = f.read_bytes()
                n_bytes[split] += len(data)
                digest.update(f"{split}:{f.relative_to(self.root).as_posix()}\n".encode())
                digest.update(hashlib.sha256(data).digest())
        return {
            "root": str(self.root),
            "train_files": len(self.train),
            "val_files": len(self.val),
            "train_bytes": n_bytes["train"],
            "val_bytes": n_bytes["val"],
            "sha256": digest.hexdigest(),
        }


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library at ``root`` (default: this Python's)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_files(root: Path) -> list[Path]:
    """Sorted non-empty UTF-8 files under ``root`` (hidden files and folders skipped)."""
    found = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        data = p.read_bytes()
        if not data.strip() or b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        found.append(p)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def is_validation(rel_path: str, fraction: float = VAL_FRACTION) -> bool:
    """True for the ~``fraction`` of paths whose SHA-256 falls lowest (stable across runs)."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h < fraction * 2**64


def load_corpus(corpus_dir: str | Path | None = None, val_fraction: float = VAL_FRACTION) -> Corpus:
    """The default stdlib corpus, or the text files under ``corpus_dir``, split by file.

    At least one file goes to each side: when the hash picks none for validation, the file with
    the lowest hash does. Raises FileNotFoundError for a missing folder and ValueError when it
    holds fewer than two text files.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1); e.g. {VAL_FRACTION}")
    if corpus_dir is None:
        root = Path(sysconfig.get_paths()["stdlib"]).resolve()
        files = stdlib_files(root)
        what = f"the standard library at {root}"
    else:
        root = Path(corpus_dir).resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"corpus folder {root} not found; pass a folder of text files")
        files = text_files(root)
        what = f"corpus folder {root}"
    if len(files) < 2:
        raise ValueError(
            f"{what} holds {len(files)} non-empty UTF-8 text file(s); the corpus needs at least "
            "2 (one for training, one for validation): point --corpus at a folder of text files"
        )
    rel = {f: f.relative_to(root).as_posix() for f in files}
    val = [f for f in files if is_validation(rel[f], val_fraction)]
    if not val:
        val = [min(files, key=lambda f: hashlib.sha256(rel[f].encode()).digest())]
    if len(val) == len(files):
        val = val[:-1]
    train = [f for f in files if f not in set(val)]
    return Corpus(root=root, train=tuple(train), val=tuple(val))


def read_text(path: Path) -> str:
    """A corpus file as text; stray undecodable bytes (rare in the stdlib) become U+FFFD."""
    return path.read_bytes().decode("utf-8", errors="replace")
