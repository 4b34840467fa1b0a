"""The code in docs/*.md runs as written (issue 38).

* Every ```python block of a page runs, in order, in one namespace per page (after the setup
  below for the names a page leaves to the reader), unless the line just before it is an HTML
  comment ``<!-- not run: REASON -->``: a visible, deliberate skip (a download, a GPU, several
  processes, minutes of CPU, or a listing that is no call).
* Every ``clipless ...`` line of a shell block (```bash, ```sh, ```console or an untagged fence;
  ```text is a listing) in docs/*.md and README.md parses with the real parser, and every
  ``--option`` of an inline ```clipless SUBCOMMAND ...``` span in the prose is one that
  subcommand has: an option renamed in the code but not in the docs fails here.
* The shell commands that need no download, no second process and no minutes of CPU run as
  written, in page order, on made-up input files (:data:`NOT_RUN_COMMANDS` says why the others
  do not); the session and secret files the skipped federated commands read are where
  ``federated init`` put them.
* The ``make_private`` listing of docs/opacus-migration.md (every argument at its default) is
  checked against the real signature.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->", re.DOTALL)
SHELL = ("", "bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    not_run: str | None  # the reason given in the marker before it


def blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        marker = NOT_RUN.fullmatch(before.strip())
        line = text.count("\n", 0, match.start()) + 1
        reason = marker.group(1) if marker else None
        found.append(Block(path, line, match.group(1), match.group(2), reason))
    return found


# ------------------------------------------------------------------------- the python blocks
PRIVATE_SETUP = """
import torch
from torch.utils.data import DataLoader, TensorDataset
import clipless
import clipless.nn as cnn
from clipless import PrivacyEngine

torch.manual_seed(0)
_x = torch.randn(64, 4)
model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(TensorDataset(_x, (_x[:, 0] > 0).long()), batch_size=16)
criterion = cnn.CrossEntropyLoss()
engine = PrivacyEngine()
"""
"""A tiny model, optimizer, loader, loss and engine (the names docs/opacus-migration.md uses)."""


SETUP: dict[str, str] = {
    # model, x, y: a small certified MLP (weights projected to operator norm <= 1) and its data
    "robustness.md": """
import torch
from clipless import models
from clipless.constraints import project

torch.manual_seed(0)
model = models.mlp((6,), (8,), 3, 2.0, False)
project(model, mode="clip", max_norm=1.0)
x = torch.randn(40, 6)
y = model(x).argmax(dim=1)
""",
    # engine, model, optimizer, train_loader, criterion (and clipless) as in the page's table
    "opacus-migration.md": PRIVATE_SETUP,
}


def _check_robustness(space: dict[str, Any]) -> None:
    """What the page's comments say: L-inf radii are r_2 / sqrt(n); the certified accuracy is
    at most the clean one and at most PGD's (an upper bound) at each radius."""
    cert, acc, x = space["cert"], space["acc"], space["x"]
    expected = cert.radii / math.sqrt(x[0].numel())
    torch.testing.assert_close(cert.linf_radii(), expected, rtol=1e-6, atol=0)
    empirical = space["empirical_accuracy"](space["model"], x, space["y"], [0.1, 0.25, 0.5])
    assert acc.accuracy == 1.0  # y is the model's own prediction
    for certified, attacked in zip(acc.certified, empirical, strict=True):
        assert certified <= attacked <= 1.0


def _check_opacus(space: dict[str, Any]) -> None:
    """make_private_with_epsilon calibrated the noise so that 20 epochs spend at most 3.0."""
    from clipless.optim import DPOptimizer

    assert isinstance(space["optimizer"], DPOptimizer)
    planned = space["engine"].privacy_config
    assert planned.steps == 20 * len(space["train_loader"])  # 20 epochs of 4 expected batches
    assert 2.9 < planned.epsilon(1e-5) <= 3.0


def _check_federated(space: dict[str, Any]) -> None:
    assert space["fed"].ecdf.values.shape == (64,)  # the page's own assert compares the rest


AFTER = {
    "robustness.md": _check_robustness,
    "opacus-migration.md": _check_opacus,
    "federated.md": _check_federated,
}

PYTHON_DOCS = [p for p in DOCS if any(b.lang == "python" for b in blocks(p))]


@pytest.mark.parametrize("path", PYTHON_DOCS, ids=[p.name for p in PYTHON_DOCS])
def test_python_blocks_run_as_written(path: Path) -> None:
    space: dict[str, Any] = {"__name__": f"docs.{path.stem}"}
    exec(compile(SETUP.get(path.name, ""), f"setup for {path.name}", "exec"), space)
    python = [b for b in blocks(path) if b.lang == "python"]
    ran = 0
    with contextlib.redirect_stdout(io.StringIO()):
        for block in python:
            if block.not_run is None:
                exec(compile(block.code, f"{path}:{block.line}", "exec"), space)
                ran += 1
    assert ran == sum(1 for b in python if b.not_run is None) > 0
    if path.name in AFTER:
        AFTER[path.name](space)


def test_every_skipped_block_says_why() -> None:
    """The skips are the ones reviewed: a new one must be added here with its reason."""
    skipped = {
        (b.path.name, b.line): b.not_run for p in DOCS for b in blocks(p) if b.lang == "python"
    }
    skipped = {k: v for k, v in skipped.items() if v is not None}
    assert {name for name, _ in skipped} <= {"opacus-migration.md"}, skipped
    assert all(len(reason) > 10 for reason in skipped.values())


# ---------------------------------------------------------------- the make_private listing
class _Recorder:
    """Stands in for the engine: records the keywords the listing passes."""

    def make_private(self, **kwargs: Any) -> tuple[None, None, None]:
        self.kwargs = kwargs
        return None, None, None


def test_make_private_listing_is_the_real_signature() -> None:
    import clipless
    from clipless import PrivacyEngine

    path = ROOT / "docs" / "opacus-migration.md"
    (listing,) = [b for b in blocks(path) if "engine.make_private(" in b.code]
    assert listing.not_run is not None  # a listing, not a call (neither sigma nor epsilon)
    reader = {"model", "optimizer", "train_loader", "criterion"}
    engine = _Recorder()
    space: dict[str, Any] = {"clipless": clipless, "engine": engine, "opacus_options": {}}
    space |= {name: f"<{name}>" for name in reader}
    exec(compile(listing.code, f"{path}:{listing.line}", "exec"), space)
    signature = inspect.signature(PrivacyEngine.make_private).parameters
    named = {k for k, p in signature.items() if k != "self" and p.kind is p.KEYWORD_ONLY}
    assert set(engine.kwargs) == named  # every keyword, none invented
    for name, value in engine.kwargs.items():
        default = signature[name].default
        if isinstance(value, str) and value.startswith("<"):  # the reader's objects
            continue
        if name == "mechanism":
            assert value == clipless.MechanismSpec() and default is None  # None: the default
        elif name == "options":
            assert value == clipless.RunOptions() and default is None
        else:
            assert value == default, name


# ------------------------------------------------------------------------ the shell commands
def _commands(path: Path) -> list[tuple[int, list[str]]]:
    """``(line, argv after 'clipless')`` of every clipless line in the page's shell blocks."""
    return [(line, argv) for line, argv, _ in _command_lines(path)]


def _command_lines(path: Path) -> list[tuple[int, list[str], bool]]:
    """:func:`_commands` with whether another program launches clipless (``torchrun ... -m``)."""
    found: list[tuple[int, list[str], bool]] = []
    for block in blocks(path):
        if block.lang not in SHELL:
            continue
        lines = block.code.split("\n")
        for offset, first in enumerate(lines):
            if offset and lines[offset - 1].endswith("\\"):
                continue  # joined to the line it continues
            line, at = first, offset
            while line.endswith("\\") and at + 1 < len(lines):
                at += 1
                line = line[:-1] + " " + lines[at]
            tokens = shlex.split(line.removeprefix("$ "), comments=True)
            if "clipless" not in tokens:
                continue
            where = tokens.index("clipless")
            if where == 0 or tokens[where - 1] == "-m":  # clipless ..., torchrun ... -m clipless
                found.append((block.line + 1 + offset, tokens[where + 1 :], where > 0))
    return found


SHELL_PAGES = [*DOCS, ROOT / "README.md"]


def _parser() -> argparse.ArgumentParser:
    from clipless.cli import build_parser

    return build_parser()


@pytest.mark.parametrize("path", SHELL_PAGES, ids=[p.name for p in SHELL_PAGES])
def test_shell_commands_parse(path: Path) -> None:
    parser = _parser()
    for line, argv in _commands(path):
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv)
        except SystemExit as exc:
            assert not exc.code, (
                f"{path.name}:{line}: clipless {shlex.join(argv)}: {errors.getvalue()}"
            )
        _check_options(parser, argv, f"{path.name}:{line}: clipless {shlex.join(argv)}")


def test_the_pages_hold_the_commands_they_document() -> None:
    """The shell check sees the commands (a change of fence or layout that hid them would fail)."""
    counts = {p.name: len(_commands(p)) for p in SHELL_PAGES}
    assert counts["cli.md"] >= 8 and counts["README.md"] >= 8 and counts["federated.md"] >= 6
    assert sum(counts.values()) >= 30


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def _inline_spans(path: Path) -> list[str]:
    prose = FENCE.sub("", path.read_text(encoding="utf-8"))
    return re.findall(r"`(clipless [^`]+)`", prose)


def _check_options(root: argparse.ArgumentParser, tokens: list[str], where: str) -> None:
    """The subcommands of ``tokens`` (``clipless`` left out) exist and every ``--option`` is
    one of the last one's, spelled in full (argparse would also take a prefix of a longer,
    renamed option); values may be placeholders such as ``N`` or ``SPEC``."""
    parser = root
    for token in tokens:
        if token.startswith("-") or token in ("...", "…") or token.isupper():
            break
        names = token.split("|")
        if _subparser(parser, names[0]) is None and parser is not root:
            break  # a positional argument (RUN_DIR, FILE.csv) of the subcommand
        subs = [_subparser(parser, n) for n in names]
        assert all(s is not None for s in subs), f"{where}: no subcommand {token}"
        if len(names) > 1:
            break
        parser = subs[0]  # type: ignore[assignment]
    for token in tokens:
        option = token.split("=")[0]
        if option.startswith("--"):
            assert option in parser._option_string_actions, (
                f"{where}: {parser.prog} has no {option}"
            )


@pytest.mark.parametrize("path", SHELL_PAGES, ids=[p.name for p in SHELL_PAGES])
def test_inline_commands_name_real_options(path: Path) -> None:
    """```clipless train --foo X``` in the prose: ``train`` is a subcommand and ``--foo`` one of
    its options."""
    root = _parser()
    for span in _inline_spans(path):
        _check_options(root, [t.strip("[]") for t in span.split()[1:]], f"{path.name}: `{span}`")


# ------------------------------------------------------------- the shell commands, run
NOT_RUN_COMMANDS: tuple[tuple[str, str], ...] = (
    ("federated simulate", "several processes (servers and owners) on this machine"),
    ("federated serve", "a server waiting for the owners over the network"),
    ("federated owner", "a party talking to servers over the network"),
    ("federated dealer", "a party talking to servers over the network"),
    ("federated analyst", "a party talking to servers over the network"),
    ("data fetch", "a download"),
    ("--nproc", "several processes"),
    ("photos/", "an image folder of your own"),
    ("--model cnn", "minutes of CPU (a ConvNet for 30 epochs)"),
)
"""Commands of the pages that are parsed (above) but not run: a word of the line, and why."""


def _why_not_run(argv: list[str], launcher: bool) -> str | None:
    if launcher:
        return "under torchrun: several processes"
    line = f" {shlex.join(argv)} "
    return next((why for word, why in NOT_RUN_COMMANDS if f" {word} " in line), None)


def _inputs(folder: Path) -> None:
    """The files the pages' commands read, made up (each page names them as placeholders)."""
    import csv

    g = torch.Generator().manual_seed(0)
    age = torch.randint(17, 91, (400,), generator=g)
    hours = torch.randint(0, 100, (400,), generator=g)
    score = torch.randn(400, generator=g, dtype=torch.float64)
    label = (score + (age - 50) / 20 > 0).long()
    pairs = list(zip(score.tolist(), label.tolist(), strict=True))
    rows = {
        "data.csv": (["age"], [[int(a)] for a in age]),
        "scores.csv": (["s", "p", "y"], [[s, s, y] for s, y in pairs]),
        "preds.csv": (["p", "y"], [[1 / (1 + math.exp(-s)), y] for s, y in pairs]),
        "people.csv": (
            ["age", "hours", "sex", "income"],
            [[int(a), int(h), ("Male", "Female")[i % 2], ("<=50K", ">50K")[int(y)]]
             for i, (a, h, y) in enumerate(zip(age, hours, label, strict=True))],
        ),
    }  # fmt: skip
    for name, (header, body) in rows.items():
        with (folder / name).open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(body)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    sex = [("Male", "Female")[i % 2] for i in range(len(age))]
    income = [("no", "yes")[int(y)] for y in label]
    table = pa.table({"age": age.tolist(), "sex": sex, "income": income})
    pq.write_table(table, folder / "people.parquet")


WRITTEN = (
    "runs/demo/metrics.json",
    "runs/demo/model.pt",
    "runs/demo/robustness.png",
    "runs/people/model.pt",
    "runs/table/model.pt",
    "out/ecdf.csv",
    "out/quantiles.csv",
    "out/ecdf.png",
    "out/roc.csv",
    "out/roc.png",
    "q/quantiles.csv",
    "hl/hl.csv",
)
"""Files the pages say those commands write (docs/cli.md)."""


def test_shell_commands_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands that need no download, no second process and no minutes of CPU run, in one
    folder, in page order (README.md first), each line once, with made-up input files."""
    from clipless.cli import main

    _inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    ran: list[str] = []
    skipped: dict[str, str] = {}
    for path in [ROOT / "README.md", *DOCS]:
        for line, argv, launched in _command_lines(path):
            text = shlex.join(argv)
            why = _why_not_run(argv, launched)
            if why is not None:
                skipped[text] = why
                # the files it reads (a session, a secret) are where the commands before put them
                for name in (a for a in argv if a.endswith(".json")):
                    assert (tmp_path / name).is_file(), f"{path.name}:{line}: no {name}"
                continue
            if text in ran:
                continue
            status = main(argv)
            assert status == 0, f"{path.name}:{line}: clipless {text}: {capsys.readouterr().err}"
            ran.append(text)
    capsys.readouterr()
    assert len(ran) >= 16 and len(skipped) >= 12, (ran, skipped)
    # what the pages say these commands write
    for written in WRITTEN:
        assert (tmp_path / written).is_file(), written
