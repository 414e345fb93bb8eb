"""Colour themes from TOML files: the bundled ones (beside this file, read with importlib.resources from a wheel
or a checkout alike) and the user's in <config dir>/themes.

A file holds the keyword arguments of textual.theme.Theme. Each theme is checked as far as Textual would
check it when applied, because Textual only fails later, when the app switches to it: a bad colour or
variable there stops the app. A broken file is skipped with a warning instead.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import fields
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from textual.color import Color, ColorParseError
from textual.css.stylesheet import Stylesheet
from textual.theme import Theme

from tuichat import paths

_KEYS = [f.name for f in fields(Theme)]
_COLOURS = ("primary", "secondary", "warning", "error", "success", "accent", "foreground", "background",
            "surface", "panel", "boost")


def bundled_themes_dir() -> Traversable:
    return resources.files(__name__)


def user_themes_dir() -> Path:
    return paths.config_dir() / "themes"


def _is_colour(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        Color.parse(value)
    except ColorParseError:
        return False
    return True


def _check_variable(name: str, value: str, variables: dict[str, str]) -> None:
    # Textual's own variables are colours except the *-text-style ones; a custom variable is assumed to be a
    # colour too. Parsing one declaration that uses it is what Textual does with the app's CSS.
    prop, kind = ("text-style", "a text style") if name.endswith("text-style") else ("color", "a colour")
    stylesheet = Stylesheet(variables=variables)
    stylesheet.add_source(f"Widget {{ {prop}: ${name}; }}", read_from=("theme", name))
    try:
        stylesheet.parse()
    except Exception as error:  # StylesheetParseError, or a tokenizer error for stray braces
        raise ValueError(f'variable "{name}" = "{value}" is not {kind}') from error


def theme_from_dict(data: dict[str, Any]) -> Theme:
    """A Theme that Textual can apply, or ValueError saying what is wrong with `data`."""
    for key in data:
        if key not in _KEYS:
            raise ValueError(f'unknown key "{key}"')
    for key in ("name", "primary"):
        if key not in data:
            raise ValueError(f'"{key}" is missing')
    if not isinstance(data["name"], str) or not data["name"].strip():
        raise ValueError('"name" must be a non-empty string')
    for key in _COLOURS:
        if key in data and not _is_colour(data[key]):
            raise ValueError(f'"{key}" = {data[key]!r} is not a colour')
    for key in ("dark", "ansi"):
        if key in data and not isinstance(data[key], bool):
            raise ValueError(f'"{key}" must be true or false')
    for key in ("luminosity_spread", "text_alpha"):
        value = data.get(key, 0.0)
        if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= 1:
            raise ValueError(f'"{key}" must be a number from 0 to 1')
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise ValueError('"variables" must be a table of strings')
    theme = Theme(**data)
    generated = theme.to_color_system().generate()
    for name, value in variables.items():
        _check_variable(name, value, generated)
    return theme


def load_themes(user_dir: Traversable | None = None) -> tuple[list[Theme], list[str]]:
    """The bundled themes, then the user's (default: user_themes_dir()); a user theme with the name of a
    bundled one replaces it in place. Returns the themes and a warning for each file skipped. Never raises."""
    themes: dict[str, Theme] = {}
    warnings: list[str] = []
    folders = [bundled_themes_dir()]
    try:
        folders.append(user_dir or user_themes_dir())
    except OSError as error:  # the config dir cannot be created
        warnings.append(f"Your themes cannot be loaded: {error}.")
    for folder in folders:
        try:
            files = sorted((f for f in folder.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
        except FileNotFoundError:  # no user themes folder yet
            continue
        except OSError as error:
            warnings.append(f"{folder}: themes cannot be listed ({error}).")
            continue
        for path in files:
            try:
                theme = theme_from_dict(tomllib.loads(path.read_text(encoding="utf-8")))
            except tomllib.TOMLDecodeError as error:
                warnings.append(f"{path}: theme skipped, not valid TOML ({error}).")
                continue
            except (OSError, UnicodeDecodeError, ValueError) as error:
                warnings.append(f"{path}: theme skipped, {error}.")
                continue
            themes[theme.name] = theme
    return list(themes.values()), warnings
