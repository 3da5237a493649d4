"""One policy table for every user surface (`plan.policies.POLICIES`: `dcp`, `bucket`,
`packed`): `[train] policy`, `dcparallel train`, `DataCentricParallel`, `DataCentricLoader`
and the Trainer's `DataCentricArguments` accept exactly it, and refuse a research policy's
name with what it is, the choices and where it runs; the API and the loader take a research
name only with ``research=True``; `dcparallel simulate` and `dcparallel plan` take every name,
and the command line's defaults are the user table's."""

from __future__ import annotations

import contextlib
import inspect
import io
from collections.abc import Callable
from pathlib import Path

import pytest

from dcparallel.apps import cli, simulate
from dcparallel.apps.simulate_words import USER_POLICIES
from dcparallel.apps.train_config import Config, TrainConfig
from dcparallel.plan.policies import COMPARED, NAMES, POLICIES, RESEARCH

from .test_loader import make, text_data

USERS = "choose one of dcp, bucket, packed"


def _train_config(name: str, research: bool, tmp_path: Path) -> None:
    Config.from_dict({"train": {"policy": name}}, "run.toml")


def _train_command(name: str, research: bool, tmp_path: Path) -> None:
    """`dcparallel train --config run.toml --check`: its error, raised again."""
    path = tmp_path / "run.toml"
    path.write_text(f'[train]\npolicy = "{name}"\nout_dir = "{tmp_path / "out"}"\n')
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = cli.main(["train", "--config", str(path), "--check"])
    if rc != 0:
        raise ValueError(err.getvalue())
    assert "config OK" in out.getvalue() and f"policy {name}" in out.getvalue()


def _api(name: str, research: bool, tmp_path: Path) -> None:
    from dcparallel.api import DataCentricParallel
    from dcparallel.models.llama import Llama, LlamaConfig

    dc = DataCentricParallel(Llama(LlamaConfig(num_layers=1)), policy=name, research=research)
    assert dc.policy == name


def _loader(name: str, research: bool, tmp_path: Path) -> None:
    ds, lens = text_data(8)
    loader = make(ds, lens, policy=name, research=research, planning="thread", lookahead=0)
    assert loader.policy == name


def _trainer_arguments(name: str, research: bool, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from dcparallel.integrations.hf_trainer import DataCentricArguments

    assert DataCentricArguments(policy=name).policy == name


#: surface (as its error names it) -> a function that builds it with a policy name
SURFACES: dict[str, Callable[[str, bool, Path], None]] = {
    "run.toml: [train] policy": _train_config,
    "[train] policy": _train_command,
    "DataCentricParallel": _api,
    "DataCentricLoader": _loader,
    "DataCentricArguments": _trainer_arguments,
}
#: the surfaces with an explicit flag for research policies
FLAGGED = ("DataCentricParallel", "DataCentricLoader")


def refusal(surface: str, name: str, tmp_path: Path, research: bool = False) -> str | None:
    """The surface's error for policy ``name``; None where it accepts the name."""
    try:
        SURFACES[surface](name, research, tmp_path)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("surface", SURFACES)
def test_every_user_surface_accepts_exactly_the_user_table(surface, tmp_path):
    errors = {name: refusal(surface, name, tmp_path) for name in (*NAMES, "fast")}
    assert [name for name, e in errors.items() if e is None] == list(POLICIES)
    for name in RESEARCH:
        e = errors[name]
        assert f"{surface}: {name!r} is a research policy" in e, e
        assert USERS in e and f"`dcparallel simulate --policy {name}`" in e, e
        assert ("or pass research=True" in e) == (surface in FLAGGED), e
    assert f"{surface}: unknown policy 'fast'; {USERS}" in errors["fast"]


@pytest.mark.parametrize("surface", FLAGGED)
def test_research_true_takes_every_policy_on_the_api_and_the_loader(surface, tmp_path):
    assert {name: refusal(surface, name, tmp_path, research=True) for name in NAMES} == dict.fromkeys(NAMES)
    assert "(research: bucket-default, " in refusal(surface, "fast", tmp_path, research=True)


def test_the_defaults_are_the_user_table():
    from dcparallel.api import DataCentricParallel
    from dcparallel.apps import demo
    from dcparallel.data import DataCentricLoader

    defaults = [inspect.signature(f).parameters["policy"].default for f in (DataCentricParallel, DataCentricLoader)]
    assert defaults + [TrainConfig().policy] == ["dcp"] * 3
    assert set(COMPARED) == set(POLICIES) and USER_POLICIES == demo.POLICIES == COMPARED == ("bucket", "packed", "dcp")


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_simulate_and_plan_take_every_policy_by_name(command, monkeypatch):
    """The research commands' parsers take every name, user and research; without --policy
    `plan` plans `dcp` (`simulate` runs `USER_POLICIES`, tests/unit/test_simulate_words.py)."""
    seen = []
    monkeypatch.setattr(simulate, f"cmd_{command}", lambda args: seen.append(args.policy) or 0)
    for name in NAMES:
        assert cli.main([command, "--scenario", "text", "--policy", name]) == 0
    assert cli.main([command, "--scenario", "text"]) == 0
    wanted = [[n] for n in NAMES] + [None] if command == "simulate" else [*NAMES, "dcp"]
    assert seen == wanted
