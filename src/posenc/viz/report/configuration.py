"""The configuration section: the command line that reproduces the folder, then every setting of
``config.json`` in a collapsed table."""

from __future__ import annotations

import datetime as _dt
import html
import json
from typing import Any

from ...experiments.results.folders import reproduce_command
from ...experiments.study.plan import study_command
from .view import FolderView, experiment_config

__all__ = ["HEADING", "ID", "render"]

ID = "config"
HEADING = "Configuration"


def render(view: FolderView) -> str:
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return _command(view) + (
        f'<details id="configuration"><summary>Settings ({html.escape(str(view.directory))}, generated {when})'
        f"</summary>{_settings_table(view.config)}</details>"
    )


def _command(view: FolderView) -> str:
    """The command line that reproduces the folder: recorded in ``config.json`` by the runner, or
    derived from the settings for a folder that does not record it (a merge, an older version)."""
    command, caveats, how = _recorded_or_derived(view)
    if command is None:
        return "<p>No command line: this folder's config.json neither records nor implies one.</p>"
    notes = "".join(f'<p class="note">not reproduced: {html.escape(c)}</p>' for c in caveats)
    return (
        f'<p>Reproduce this folder ({html.escape(how)}):</p><pre id="command"><code>'
        f"{html.escape(str(command))}</code></pre>{notes}"
    )


def _recorded_or_derived(view: FolderView) -> tuple[Any, list[str], str]:
    """``(command or None, what it does not reproduce, how it was found)``."""
    runtime = view.config.get("runtime") if isinstance(view.config.get("runtime"), dict) else {}
    command, caveats = runtime.get("command"), list(runtime.get("command_caveats", []))
    if command is not None:
        return command, caveats, "as recorded in config.json"
    settings = view.settings
    how = "as recorded in config.json"
    if "task" in settings and not view.pretrained:
        try:
            command, caveats = reproduce_command(experiment_config(settings), view.directory)
        except (TypeError, ValueError):
            command = None
        how = "derived from config.json (this folder does not record its command)"
    if command is None and view.study:
        return study_command(settings, view.directory), caveats, "derived from config.json"
    return command, caveats, how


def _settings_table(config: dict[str, Any]) -> str:
    if not config:
        return "<p>No config.json in this directory.</p>"
    # One level of nesting ({"experiment": {...}, "runtime": {...}}) becomes dotted keys.
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{inner}": item for inner, item in value.items()})
        else:
            flat[key] = value
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td><code>{html.escape(json.dumps(v))}</code></td></tr>"
        for k, v in flat.items()
    )
    return f'<table id="config">{rows}</table>'
