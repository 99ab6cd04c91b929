"""The run's configuration: the root `Config` (root.py) composed of one section per concern (the
other modules here, each a leaf: no torch, nothing of the package above), strict YAML loading with
`--set` overrides, and `validate` (validate.py), which runs every check before a worker starts."""

from raytrain_fast.config.root import (
    Config,
    load_config,
    presets,
    reference_markdown,
    resolve_config_path,
)
from raytrain_fast.config.validate import validate
