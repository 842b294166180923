"""The docs say what the code is: the README's configuration sections, its layout, the keys ``mobius plan`` reads,
the plan's options in partition/README.md, the test command, and every relative link (anchors too)."""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from pathlib import Path

import pytest

from in_process import mobius

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PACKAGES = ("mobius", "topology", "partition", "scheduler")
PACKAGE_READMES = ("partition", "scheduler", "scheduler/zero", "topology")  # each lists its package's modules


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown text, up to the next heading of its level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def outside_code(text: str) -> str:
    """``text`` with its fenced code blocks blanked out (their lines kept, empty)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def test_readme_is_a_page_a_user_reads():
    """At most about 300 lines, and the first screen says how to fine-tune a checkpoint on one's own data."""
    lines = README.read_text().split("\n")
    assert len(lines) <= 300
    first_screen = "\n".join(lines[:60])
    for what in ("checkpoint:", "data:", "mobius data run.yaml", "mobius train run.yaml"):
        assert what in first_screen, what


# ---- the configuration sections ------------------------------------------------------------------------------
def test_the_readmes_configuration_sections_are_the_configs():
    from mobius.config import _sections

    rows = re.findall(r"^\| `(\w+)` \|", section(README.read_text(), "Configuration"), re.M)
    assert rows == [f.name for f in _sections()]


# ---- the layout ----------------------------------------------------------------------------------------------
def layout_entries() -> list[tuple[Path, str]]:
    """(the package directory a line of the README's layout is under, each name it gives in backquotes)."""
    out, current = [], ROOT
    for line in section(README.read_text(), "Layout").split("\n"):
        names = re.findall(r"`([^`]+)`", line)
        if line.startswith("- ") and names:
            current = ROOT / names[0]
        out += [(ROOT if line.startswith("- ") else current, n) for n in names]
    return out


def _is_path(name: str) -> bool:
    return name.endswith(("/", ".py", ".md", ".cpp", ".jinja", ".yaml")) or name == ".ci/run"


def test_every_path_the_readmes_layout_names_exists():
    missing = [f"{base.relative_to(ROOT)}/{name}" for base, name in layout_entries()
               if _is_path(name) and not ((base / name).exists() or (ROOT / name).exists())]
    assert not missing


def modules_of(package: Path) -> set[str]:
    """A package's top-level modules and sub-folders (``__init__.py``, private ``_x.py`` and caches left out)."""
    out = {p.name for p in package.glob("*.py") if not p.name.startswith("_") or p.name == "__main__.py"}
    out |= {p.name + "/" for p in package.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_the_readmes_layout_names_every_top_level_module(package):
    named = {name for base, name in layout_entries() if base == ROOT / package}
    assert modules_of(ROOT / package) - named == set()


@pytest.mark.parametrize("folder", PACKAGE_READMES)
def test_a_package_readme_names_every_module_of_its_package(folder):
    text = (ROOT / folder / "README.md").read_text()
    names = {m for m in modules_of(ROOT / folder) if m.endswith(".py") and m != "__main__.py"}
    names |= {m for m in modules_of(ROOT / folder) if (ROOT / folder / m / "__init__.py").exists()}
    assert {m for m in names if f"`{m}`" not in text and f"`{folder}/{m}`" not in text} == set()


# ---- the keys mobius plan reads -------------------------------------------------------------------------------
def documented_plan_keys() -> dict[str, set[str]]:
    """``mobius/commands/plan.py``'s docstring list: section -> keys (``*``: every key of the section)."""
    import mobius.commands.plan as plan_command

    doc = plan_command.__doc__
    block = doc[doc.index("Config keys read"):].split("\n\n")[1]
    out: dict[str, set[str]] = {}
    for entry in re.split(r"\n(?=    \w+:)", block.strip("\n")):
        name, keys = entry.split(":", 1)
        out[name.strip()] = {k.strip() for k in keys.replace("\n", " ").split(",")}
    return out


def config_keys() -> dict[str, set[str]]:
    """section -> its keys, from :class:`mobius.config.Config`."""
    import typing

    from mobius.config import Config, _sections

    hints = typing.get_type_hints(Config)
    return {f.name: {g.name for g in dataclasses.fields(hints[f.name])} for f in _sections()}


def test_the_keys_mobius_plan_lists_are_keys_of_the_config():
    keys, documented = config_keys(), documented_plan_keys()
    assert set(documented) <= set(keys)
    wrong = {f"{s}.{k}" for s, ks in documented.items() for k in ks if k != "*" and k not in keys[s]}
    assert not wrong


def _recording(cls: type, name: str, seen: set[str], cache: dict) -> type:
    """A subclass of the section ``cls`` that adds ``name.key`` to ``seen`` for every key read."""
    if cls not in cache:
        keys = {f.name for f in dataclasses.fields(cls)}

        def __getattribute__(self, attr):
            if attr in keys:
                seen.add(f"{name}.{attr}")
            return object.__getattribute__(self, attr)

        cache[cls] = type(f"Recording{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})
    return cache[cls]


def test_a_plan_reads_only_the_keys_the_docstring_lists(tmp_path, monkeypatch):
    """``mobius plan`` of a pipeline (both schedules, LoRA, the delayed update, packed conversations), of zero mode
    and of auto's comparison, with every key read recorded."""
    import mobius.commands.plan as plan_command
    from mobius import config

    seen: set[str] = set()
    cache: dict = {}
    load = config.load_config

    def recorded(path, overrides=None):
        cfg = load(path, overrides)
        for f in config._sections():
            part = getattr(cfg, f.name)
            rec = object.__new__(_recording(type(part), f.name, seen, cache))
            rec.__dict__.update(part.__dict__)
            setattr(cfg, f.name, rec)
        return cfg

    monkeypatch.setattr(plan_command, "load_config", recorded)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                      {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n"
                             for i in range(40)))
    common = ["configs/demo.yaml", "--gpus", "2", "--partition.gpu=rtx3090", "--partition.time_limit_s=0.3",
              f"--partition.cache_dir={tmp_path / 'plans'}", f"--data.cache_dir={tmp_path / 'data'}", "--json"]
    runs = [["--parallel.mode=auto", "--parallel.schedule=auto", "--lora.rank=4", "--train.update=delayed"],
            ["--parallel.mode=zero"],
            ["--parallel.mode=pipeline", f"--data.path={chats}", "--data.chat_template=builtin:demo-chat"]]
    for extra in runs:
        result = mobius(["plan", *common, *extra], cwd=ROOT)
        assert result.returncode == 0, result.stderr[-2000:]
    documented = documented_plan_keys()
    unlisted = {k for k in seen if "*" not in documented.get(k.split(".")[0], ())
                and k.split(".")[1] not in documented.get(k.split(".")[0], ())}
    assert not unlisted
    assert {"train.update", "parallel.schedule", "lora.rank", "parallel.cpu_threads", "data.chat_template"} <= seen


def test_partition_readme_names_every_option_plan_json_flattens():
    from partition.schedule import PipelineOptions

    text = (ROOT / "partition" / "README.md").read_text()
    listed = re.search(r"\(`PipelineOptions`: ([^)]*)\)", text).group(1)
    assert re.findall(r"`(\w+)`", listed) == [f.name for f in dataclasses.fields(PipelineOptions)]


# ---- the test command -----------------------------------------------------------------------------------------
def test_the_readmes_test_command_is_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^TEST_COMMAND='(.*)'$", ci, re.M).group(1)
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert blocks[1].strip() == command
    assert 'eval "$TEST_COMMAND"' in ci


# ---- links ---------------------------------------------------------------------------------------------------
def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))] + [ROOT / p / "README.md" for p in PACKAGE_READMES]


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text without markup, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("**", "").strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, counts = set(), {}
    for line in outside_code(path.read_text()).split("\n"):
        match = re.match(r"^#{1,6} (.*)$", line)
        if match:
            base = github_anchor(match.group(1))
            n = counts.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            counts[base] = n + 1
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", outside_code(path.read_text()))  # inline code is no link
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target} (no such heading)")
    assert not broken


def test_no_doc_points_at_shared():
    assert not [p for p in markdown_files() if "../shared" in p.read_text()]
