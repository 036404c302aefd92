"""The model config a switch is given, as the JSON text the extension reads."""

from __future__ import annotations

import json
import os
from typing import Any

from ._lifecycle import ConfigError


def _config_json(config: Any) -> str:
    """A Hugging Face config (object with ``to_json_string``), a dict, JSON text, or the path of
    a ``config.json`` as a ``pathlib.Path``."""
    if isinstance(config, os.PathLike):
        try:
            with open(config) as f:
                return f.read()
        except OSError as e:
            raise ConfigError(f"config: cannot read {os.fspath(config)!r}: {e}") from None
    if isinstance(config, str):
        try:
            json.loads(config)
        except ValueError:
            hint = (
                f"; to read the file pass pathlib.Path({config!r})"
                if os.path.exists(config)
                else ""
            )
            raise ConfigError(
                f"config: a string is read as JSON text, and {config[:60]!r} is not JSON{hint}"
            ) from None
        return config
    if isinstance(config, dict):
        return json.dumps(config)
    to_json = getattr(config, "to_json_string", None)
    if to_json is not None:
        return to_json()
    raise ConfigError(
        "config: expected a Hugging Face config, a dict, JSON text or a pathlib.Path, found "
        f"{type(config).__name__}"
    )
