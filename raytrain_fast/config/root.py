"""The root config: composes each section's dataclass (the other modules of this package), loads YAML
strictly, applies `--set section.field=value` overrides, and writes the generated reference.
Validation lives in validate.py."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from importlib import resources as package_files
from pathlib import Path
from typing import Any

import yaml

from raytrain_fast._dataclass_yaml import field_docs, from_dict, to_dict
from raytrain_fast.config.checkpoint import CheckpointConfig
from raytrain_fast.config.data import DataConfig
from raytrain_fast.config.engine import EngineConfig, OptimConfig
from raytrain_fast.errors import ConfigError
from raytrain_fast.config.resources import ResourcesConfig
from raytrain_fast.config.train import Batch, EvalConfig, HealthConfig, TrainConfig
from raytrain_fast.config.metrics import MetricsConfig
from raytrain_fast.config.model import ModelConfig
from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.config.watchdog import WatchdogConfig


DEFAULT_PRESET = "tiny"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(kw_only=True)
class Config:
    """Everything one training run needs. Each component receives only its own section."""

    name: str | None = None
    """Run name: the directory under storage.uri. Same name = same run (it resumes). null = derived from the preset."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> Config:
        problems: list[str] = []
        config = from_dict(cls, data, path="", problems=problems)
        if problems:
            raise ConfigError(problems, source=source)
        return config

    def batch(self) -> Batch:
        """The batch split of resources.num_workers workers: grad_accum explicit, or derived from the global batch."""
        micro_batch, workers = self.train.micro_batch, self.resources.num_workers
        if isinstance(micro_batch, str) or isinstance(workers, str):
            raise ValueError("train.micro_batch=auto must be resolved first (raytrain_fast.microbatch.auto.resolve_micro_batch)")
        grad_accum = self.train.grad_accum or max(1, self.train.global_batch // (micro_batch * workers))
        return Batch(micro_batch=micro_batch, grad_accum=grad_accum, world_size=workers)


PRESET_ALIASES = {"gpt2-124m": "gpt-124m"}
"""Old preset names, still accepted. Presets are named gpt-<parameters>; a run started under an old
name keeps that name (so it resumes)."""


def presets() -> dict[str, Path]:
    """Shipped presets: name -> YAML file."""
    folder = package_files.files("raytrain_fast") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"duplicate key '{key}' (line {key_node.start_mark.line + 1}): keep one of them")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file: {error.strerror}", source=str(path)) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as error:
        raise ConfigError(error.problems, source=str(path)) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"not valid YAML: {error}", source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            "the top level must be a mapping of sections (e.g. `train:` then `  steps: 500` on the next line); "
            "see docs/configuration.md", source=str(path),
        )
    return data


def resolve_config_path(config: str | None) -> Path:
    """A preset name (`tiny`) or a path to a YAML file."""
    if config is None:
        config = DEFAULT_PRESET
    shipped = presets()
    if (preset := PRESET_ALIASES.get(config, config)) in shipped:
        return shipped[preset]
    path = Path(config).expanduser()
    if path.is_file():
        return path
    names = ", ".join(sorted(shipped))
    if path.is_dir():
        raise ConfigError(f"--config '{config}' is a directory: give a YAML file in it, or a preset ({names})")
    if "/" in config or "\\" in config or path.suffix.lower() in (".yaml", ".yml", ".json"):
        raise ConfigError(
            f"--config file '{config}' does not exist (looked in {path.resolve().parent}). Check the path, "
            f"or use a preset: {names}"
        )
    import difflib

    close = difflib.get_close_matches(config, [*shipped, *PRESET_ALIASES], n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(
        f"--config '{config}' is not a preset ({hint}presets: {names}) and no file of that name exists here"
    )


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply `section.field=value` strings in place (values parsed as YAML). Returns problems."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set '{item}': expected section.field=value, e.g. train.steps=500")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"--set '{item}': '{part}' is not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    return problems


PRECISION_ALIASES = {"bfloat16": "bf16", "float32": "fp32"}
"""torch's spellings, accepted wherever the config takes bf16 / fp32 (export takes both too)."""


ON_OFF_KEYS = (("engine", "compile"), ("engine", "deepspeed_patches"), ("model", "chunked_loss"))
"""auto | on | off keys: YAML 1.1 reads a bare on/off as true/false, so those mean "on"/"off" here."""


def _accept_spellings(data: dict[str, Any]) -> None:
    """torch's dtype names, a bare on/off (ON_OFF_KEYS) and eval.tasks as a comma-separated string
    (--set eval.tasks=arc_easy,piqa), each read as the value it spells."""
    engine = data.get("engine")
    if isinstance(engine, dict) and isinstance(engine.get("precision"), str):
        engine["precision"] = PRECISION_ALIASES.get(engine["precision"].lower(), engine["precision"])
    for section, key in ON_OFF_KEYS:
        values = data.get(section)
        if isinstance(values, dict) and isinstance(values.get(key), bool):
            values[key] = "on" if values[key] else "off"
    values = data.get("eval")
    if isinstance(values, dict) and isinstance(values.get("tasks"), str):
        values["tasks"] = [task.strip() for task in values["tasks"].split(",") if task.strip()]


def load_config(config: str | None = None, overrides: list[str] | tuple[str, ...] = (), *, name: str | None = None) -> Config:
    """Read a preset or YAML file, apply overrides, and check types and unknown keys."""
    path = resolve_config_path(config)
    data = read_yaml(path)
    problems = apply_overrides(data, list(overrides))
    _accept_spellings(data)
    if name is not None:
        data["name"] = name
    structure: list[str] = []
    loaded = from_dict(Config, data, path="", problems=structure)
    problems.extend(_in_another_section(problem) for problem in structure)
    if problems:
        raise ConfigError(problems, source=str(path) + (" with --set overrides" if overrides else ""))
    if loaded.name is None:  # an old preset name stays the run's name: the run resumes under it
        loaded = dataclasses.replace(loaded, name=config if config in PRESET_ALIASES else path.stem)
    return loaded


_UNKNOWN_KEY = re.compile(r"^unknown key '([A-Za-z_]+)\.([A-Za-z_]+)' \((?!did you mean)")


def _in_another_section(problem: str) -> str:
    """An unknown `section.key` whose key is a key of another section (train.lr: optim.lr) says so."""
    match = _UNKNOWN_KEY.match(problem)
    if not match:
        return problem
    section, key = match.groups()
    homes = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)
             and f.name != section and key in {g.name for g in dataclasses.fields(f.default_factory)}]  # type: ignore[arg-type]
    if not homes:
        return problem
    return problem.replace(" (", f" (did you mean '{homes[0]}.{key}'? ", 1)


def reference_markdown() -> str:
    """The config reference table (docs/configuration.md), generated from the dataclasses' field docstrings."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |", f"| `name` | `null` | {field_docs(Config)['name']} |"]
    for section in dataclasses.fields(Config):
        if not dataclasses.is_dataclass(section.default_factory):  # type: ignore[arg-type]
            continue
        cls = section.default_factory
        docs = field_docs(cls)  # type: ignore[arg-type]
        instance = cls()  # type: ignore[operator]
        for item in dataclasses.fields(instance):
            default = yaml.safe_dump(getattr(instance, item.name), default_flow_style=True).strip()
            default = default.removesuffix("...").strip()
            lines.append(f"| `{section.name}.{item.name}` | `{default}` | {docs.get(item.name, '')} |")
    return "\n".join(lines) + "\n"
